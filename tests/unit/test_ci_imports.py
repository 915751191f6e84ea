"""ci_imports.py: a test module gated on a missing package skips locally and fails under CI;
a skip for anything else (hardware, an optional package CI lacks) stays a skip either way."""

import pytest

MISSING = "tree_grpo_jax_no_such_package"

CONFTEST = "from ci_imports import pytest_make_collect_report, pytest_runtest_makereport\n"

GATED_MODULE = f"""
import pytest

torch = pytest.importorskip("{MISSING}")


def test_needs_it():
    pass
"""

GATED_TESTS = f"""
import pytest


@pytest.fixture
def reference():
    return pytest.importorskip("{MISSING}.sub")


def test_fixture_needs_it(reference):
    pass


def test_body_needs_it():
    pytest.importorskip("{MISSING}")
"""

OTHER_SKIPS = """
import pytest


@pytest.mark.skipif(True, reason="4 processes need 4 cores")
def test_needs_cores():
    pass


def test_optional_package():
    pytest.skip("hpsv2 is not installed")


@pytest.mark.xfail(reason="known")
def test_expected_failure():
    raise AssertionError


def test_runs():
    pass
"""


@pytest.fixture
def folder(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_gated_module=GATED_MODULE, test_gated_tests=GATED_TESTS, test_other=OTHER_SKIPS
    )
    return pytester


def test_missing_package_skips_without_ci(folder, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    result = folder.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=5, xfailed=1)  # the module counts once
    assert result.ret == 0


def test_missing_package_fails_under_ci(folder, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = folder.runpytest("test_gated_tests.py", "test_other.py")
    result.assert_outcomes(passed=1, skipped=2, xfailed=1, failed=1, errors=1)
    assert result.ret != 0
    lines = [line for line in result.outlines if line.startswith(("FAILED", "ERROR"))]
    assert len(lines) == 2, result.outlines
    for line in lines:
        assert "test_gated_tests.py" in line and f"cannot import '{MISSING}" in line, line
        assert 'pip install -e ".[test]"' in line, line


def test_module_skipped_for_a_missing_package_stops_the_ci_run(folder, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = folder.runpytest()
    assert result.ret != 0
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [f"ERROR test_gated_module.py - CI: test_gated_module.py cannot import '{MISSING}' *"]
    )
    # The message is one line: the report holds nothing else.
    assert not any("Traceback" in line for line in result.outlines)


def test_collect_only_under_ci_reports_the_module(folder, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = folder.runpytest("--collect-only", "-q", "test_gated_module.py")
    assert result.ret != 0
    result.stdout.fnmatch_lines([f"*test_gated_module.py cannot import '{MISSING}'*"])
