"""The package's import graph, read from its source: no cycles, weight I/O beneath
everything that reads weights, and no module outside a family's sub-package naming it."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tree_grpo_jax"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _known(name: str) -> str:
    """The innermost package module an imported name lives in."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> set[str]:
    """Every package module `module` imports, at its top or inside a function."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {_known(a.name) for a in node.names if a.name.startswith("tree_grpo_jax")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base.startswith("tree_grpo_jax"):
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in MODULES else _known(base))
    found.discard(module)
    return found


GRAPH = {m: _imports(m) for m in MODULES}
FAMILIES = sorted(
    p.parent.name for p in (ROOT / "models").glob("*/family.py")
)  # the sub-packages that register a family


def _strongly_connected(graph):
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_every_kind_of_import():
    assert "tree_grpo_jax.weights.files" in GRAPH["tree_grpo_jax.models.base"]
    # inside a function
    assert "tree_grpo_jax.models.tiny.model" in GRAPH["tree_grpo_jax.models.tiny.family"]
    # a relative import, of a sub-module by name
    assert "tree_grpo_jax.rewards.convert.commands" in GRAPH["tree_grpo_jax.rewards.convert"]
    assert len(FAMILIES) >= 3


def test_no_import_cycles():
    cycles = [sorted(c) for c in _strongly_connected(GRAPH) if len(c) > 1]
    assert not cycles


def _below(prefix: str):
    return [m for m in GRAPH if m == prefix or m.startswith(prefix + ".")]


@pytest.mark.parametrize(
    "lower, forbidden",
    [
        ("tree_grpo_jax.weights", ("",)),  # weight I/O imports nothing else of the package
        ("tree_grpo_jax.lora", ("",)),
        (
            "tree_grpo_jax.models",
            ("rewards", "lora", "export", "train", "trainer", "build", "config", "methods"),
        ),
        ("tree_grpo_jax.rewards", ("lora", "export", "train", "trainer", "build", "config")),
    ],
)
def test_arrows_point_down(lower, forbidden):
    allowed_inside = {"tree_grpo_jax.weights"} if lower != "tree_grpo_jax.weights" else set()
    for module in _below(lower):
        for target in GRAPH[module]:
            if target.startswith(lower) or any(target.startswith(a) for a in allowed_inside):
                continue
            name = target.removeprefix("tree_grpo_jax.")
            bad = any(f == "" or name == f or name.startswith(f + ".") for f in forbidden)
            assert not bad, f"{module} imports {target}"


def test_only_a_family_sub_package_names_its_family():
    family_modules = {f"tree_grpo_jax.models.{f}" for f in FAMILIES}
    for module, targets in GRAPH.items():
        own = next((f for f in family_modules if module == f or module.startswith(f + ".")), None)
        for target in targets:
            other = next((f for f in family_modules if target.startswith(f)), None)
            assert other is None or other == own, f"{module} imports {target}"


def test_no_library_string_is_a_model_name_outside_its_family():
    from tree_grpo_jax.models import registry

    names = set(registry.model_names())
    for module, path in MODULES.items():
        if any(module.startswith(f"tree_grpo_jax.models.{f}") for f in FAMILIES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in names, f"{module}:{node.lineno} names {node.value!r}"


def test_no_library_module_is_over_about_650_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 660}
    assert not long
