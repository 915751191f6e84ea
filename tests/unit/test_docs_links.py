"""Every relative link of the README, BENCHMARKS.md and docs/ leads to a file that exists, and every
anchor to a heading of that file (as GitHub names headings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "BENCHMARKS.md",
        ROOT / "benchmarks" / "README.md",
        *(ROOT / "docs").rglob("*.md"),
    ]
)

# [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str) -> str:
    """The page without its fenced code blocks and inline code (links there are not links)."""
    lines, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            inside = not inside
            continue
        if not inside:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    inside = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            inside = not inside
            continue
        m = None if inside else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path):
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        yield target


def broken(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no such heading)")
    return bad


def test_the_slugs_are_githubs():
    # independent reference: the anchors GitHub gives these headings on its rendered pages
    assert slug("Reading a run: the progress line, the eval line, TensorBoard and wandb") == (
        "reading-a-run-the-progress-line-the-eval-line-tensorboard-and-wandb"
    )
    assert slug("10. Memory plan: `python -m benchmarks.memory_plan`") == (
        "10-memory-plan-python--m-benchmarksmemory_plan"
    )
    assert slug("Will it fit? The memory plan") == "will-it-fit-the-memory-plan"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# A heading\n")
    page.write_text(
        "# Top\n[ok](other.md#a-heading) [gone](missing.md) [bad](other.md#nope) [self](#top)\n"
        "```\n[in code](nowhere.md)\n```\n"
    )
    assert broken(page) == ["missing.md (no such file)", "other.md#nope (no such heading)"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert page.exists()
    assert not broken(page), f"{page.relative_to(ROOT)}: {broken(page)}"


def test_the_docs_are_there():
    assert len(PAGES) > 10


def test_the_plan_page_lists_every_builtin_release():
    """docs/plan.md's table names each `builtin:` release of each family, no more."""
    import importlib

    from tree_grpo_jax.models import registry

    listed = set()
    for line in (ROOT / "docs" / "plan.md").read_text().splitlines():
        if line.startswith("| `") and "`builtin:`" not in line:
            listed.update(re.findall(r"`([a-z0-9.-]+)`", line.split("|")[2]))
    known = set()
    for family in registry.families():
        try:
            module = importlib.import_module(f"tree_grpo_jax.models.{family.name}.builtin")
        except ModuleNotFoundError:
            continue  # sd keeps its releases in models/sd15
        known.update(module.RELEASES)
    known.update(importlib.import_module("tree_grpo_jax.models.sd15.builtin").RELEASES)
    assert listed == known, (sorted(listed - known), sorted(known - listed))
