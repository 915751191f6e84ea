"""Under CI (the environment variable CI is "true"), a missing test dependency fails the run.

The tests that need PyTorch references (torch, torchvision, open_clip, peft, diffusers' torch
classes, nbclient...) take them with `pytest.importorskip`, so a local checkout without the
test extra skips them. CI installs `.[test]` and must run them all: there a skip raised by
`importorskip` (a module that cannot be imported, or one older than asked) becomes a failure
whose message is one line naming the test module and the package, so a broken install cannot
pass as green. A module-level skip becomes a collection error (the run stops after collecting);
one raised in a fixture or a test becomes that test's error or failure.

Skips for something CI does not have (a core count, an optional package outside `.[test]`
such as hpsv2) use `pytest.mark.skipif` or `pytest.skip(reason)` and stay skips.

tests/conftest.py imports the two hooks; a pytester run's conftest can import them too.
"""

from __future__ import annotations

import os
import re

import pytest

# The reasons `pytest.importorskip` gives (see _pytest/outcomes.py): the module cannot be
# imported, or its __version__ is below `minversion`.
_IMPORT_REASON = re.compile(
    r"could not import '(?P<name>[^']+)': (?P<why>.*)"
    r"|module '(?P<old>[^']+)' has __version__ (?P<version>.*)"
)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def _skip_reason(report) -> str | None:
    """The message of a skip report (None for any other report or an expected failure)."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return None if longrepr is None else str(longrepr)


def missing_import_message(report) -> str | None:
    """One line for a skip report raised by `importorskip`; None for every other report."""
    reason = _skip_reason(report)
    match = _IMPORT_REASON.search(reason) if reason else None
    if match is None:
        return None
    module = report.nodeid.split("::")[0] or str(report.fspath)
    if match["name"] is not None:
        package, why = match["name"], match["why"].strip()
        problem = f"cannot import {package!r} ({why})"
    else:
        package = match["old"]
        problem = f"has {package!r} at too old a version ({match['version'].strip()})"
    return (
        f"CI: {module} {problem}, which CI must not skip: install the test extra "
        f'(pip install -e ".[test]") or fix that import.'
    )


def _fail_missing_import(report) -> None:
    if not in_ci():
        return
    message = missing_import_message(report)
    if message is not None:
        report.outcome = "failed"
        report.longrepr = message


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A test module that skips itself at import for a missing package (module level)."""
    report = yield
    _fail_missing_import(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test, or a fixture it uses, that skips for a missing package."""
    report = yield
    _fail_missing_import(report)
    return report
