"""The package's import graph, read from its source: no cycles, every arrow pointing down the
layers, no module or string outside a family's sub-package naming it, few modules at the top,
one way to cut an error to its first line, no library module reading the experiment files of
configs/, no module serving names through a module-level `__getattr__`, and no branch on a
method's objective outside the methods package. Each rule is also run on an injected
violation."""

import ast
import pathlib
import re

from tree_grpo_jax import methods

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tree_grpo_jax"


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


# The layers, bottom up: what each top-level unit of the package may import besides itself.
# The data's way reads upwards: core (spec, rollout, credit, rows) -> methods -> run (step,
# checkpoint) -> cli -> plan; models, rewards and weight I/O sit beneath the run.
BASE = {"errors", "interrupts", "core", "sharding", "gpu_flags"}
ALLOWED = {
    "errors": set(),
    "gpu_flags": set(),
    "interrupts": set(),
    "core": {"errors"},
    "sharding": set(),
    "weights": {"errors", "interrupts"},
    "models": {"errors", "core", "weights"},
    "lora": {"errors", "weights"},
    "rewards": BASE | {"weights", "models"},
    "methods": BASE | {"models"},
    "evaluation": BASE | {"weights", "models", "rewards"},
    "config": BASE | {"weights", "models", "rewards", "methods"},
    "run": BASE | {"weights", "models", "lora", "rewards", "methods", "evaluation", "config"},
    "cli": BASE
    | {"weights", "models", "lora", "rewards", "methods", "evaluation", "config", "run"},
    # the plan command and what it measures: the run's programs, compiled from shapes
    "plan": BASE
    | {"weights", "models", "lora", "rewards", "methods", "evaluation", "config", "run", "cli"},
    "train": {"run"},  # `tree_grpo_jax.train.train`, the short path of the Python entry point
    **{command: {"cli"} for command in ("main", "evaluate", "sample", "export")},
}
MAX_TOP_LEVEL_MODULES = 12


def _unit(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def upward_arrows(graph) -> list[str]:
    """Imports that leave a unit for one it may not import."""
    found = []
    for module, targets in graph.items():
        unit = _unit(module)
        for target in targets:
            other = _unit(target)
            if unit and other != unit and other not in ALLOWED.get(unit, set()):
                found.append(f"{module} imports {target}")
    return found


def top_level_modules(root: pathlib.Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.py"))


def first_line_helpers(sources: dict[str, str]) -> list[str]:
    """Places outside `tree_grpo_jax.errors` that cut a message to its first line themselves."""
    found = []
    for module, text in sources.items():
        if module == "tree_grpo_jax.errors":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and "first_line" in node.name:
                found.append(f"{module}:{node.lineno} defines {node.name}")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr == "splitlines"
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "attr", None) == "strip"
            ):
                found.append(f"{module}:{node.lineno} cuts a message with .strip().splitlines()")
    return found


SOURCES = {m: p.read_text() for m, p in MODULES.items()}


def test_every_unit_has_a_layer():
    assert {_unit(m) for m in MODULES} - {""} <= set(ALLOWED) | {"__init__"}


def test_arrows_point_down():
    assert not upward_arrows(GRAPH)


def test_an_upward_arrow_is_caught():
    injected = {**GRAPH, "tree_grpo_jax.core.rollout": {"tree_grpo_jax.run.trainer"}}
    assert upward_arrows(injected) == [
        "tree_grpo_jax.core.rollout imports tree_grpo_jax.run.trainer"
    ]
    injected = {**GRAPH, "tree_grpo_jax.weights.files": {"tree_grpo_jax.models.base"}}
    assert upward_arrows(injected)


def test_at_most_twelve_modules_at_the_top(tmp_path):
    assert len(top_level_modules(ROOT)) <= MAX_TOP_LEVEL_MODULES
    for i in range(MAX_TOP_LEVEL_MODULES + 1):
        (tmp_path / f"m{i}.py").write_text("")
    assert len(top_level_modules(tmp_path)) > MAX_TOP_LEVEL_MODULES


def test_one_first_line_helper():
    assert not first_line_helpers(SOURCES)
    own = "def _first_line(e):\n    return str(e).strip().splitlines()[0]\n"
    assert len(first_line_helpers({**SOURCES, "tree_grpo_jax.run.x": own})) == 2
    inline = "reason = str(e).strip().splitlines()[0]\n"
    assert first_line_helpers({"tree_grpo_jax.cli.x": inline})


def test_only_a_family_sub_package_names_its_family():
    family_modules = {f"tree_grpo_jax.models.{f}" for f in FAMILIES}
    for module, targets in GRAPH.items():
        own = next((f for f in family_modules if module == f or module.startswith(f + ".")), None)
        for target in targets:
            other = next(
                (f for f in family_modules if target == f or target.startswith(f + ".")), None
            )
            assert other is None or other == own, f"{module} imports {target}"


def family_references(sources: dict[str, str], names) -> list[str]:
    """Strings outside the family sub-packages that name a family or model of `names`: the
    whole string (`"wan"`), a config path into its section (`"model.wan.resolution"`,
    `"model.wan"`) or a dotted path through it (`"x.wan.y"`)."""
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    inside = re.compile(rf"(?<![\w.])model\.(?:{alternatives})(?!\w)|\.(?:{alternatives})\.")
    found = []
    for module, text in sources.items():
        if any(module.startswith(f"tree_grpo_jax.models.{f}") for f in FAMILIES):
            continue
        for node in ast.walk(ast.parse(text)):
            text_constant = isinstance(node, ast.Constant) and isinstance(node.value, str)
            if text_constant and (node.value in names or inside.search(node.value)):
                found.append(f"{module}:{node.lineno} names {node.value!r}")
    return found


def _family_names() -> set[str]:
    """The registered families' section names and the model names they load."""
    from tree_grpo_jax.models import registry

    return {f.name for f in registry.families()} | set(registry.model_names())


def test_no_library_string_names_a_family_outside_its_sub_package():
    names = _family_names()
    assert {"sd", "sd3", "flux", "wan", "tiny"} <= names
    assert not family_references(SOURCES, names)


def test_a_family_reference_is_caught():
    names = _family_names()
    injected = {
        "tree_grpo_jax.config.x": 'FIELDS = {"model.wan.resolution": int}\n',
        "tree_grpo_jax.config.y": 'section = "model.flux"\n',
        "tree_grpo_jax.run.z": 'path = "a.sd3.b"\n',
        "tree_grpo_jax.cli.w": 'if name == "tiny_flow":\n    pass\n',
    }
    assert family_references({**SOURCES, **injected}, names) == [
        "tree_grpo_jax.config.x:1 names 'model.wan.resolution'",
        "tree_grpo_jax.config.y:1 names 'model.flux'",
        "tree_grpo_jax.run.z:1 names 'a.sd3.b'",
        "tree_grpo_jax.cli.w:1 names 'tiny_flow'",
    ]
    # words that merely begin like a family, and a family's own sub-package, are not caught
    fine = {
        "tree_grpo_jax.config.v": 'log = "log.wandb_project"\nx = "model.sdxl"\n',
        "tree_grpo_jax.models.wan.family": 'FIELDS = {"model.wan.resolution": int}\n',
    }
    assert not family_references(fine, names)


def test_no_library_module_is_over_about_650_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 660}
    assert not long


def configs_imports(sources: dict[str, str]) -> list[str]:
    """Places where a library module reads the repository's configs/ folder: an import of
    `configs`, an `import_module("configs...")`, or the folder named as a path part. The
    schema is the package's (tree_grpo_jax.config); configs/ holds experiment files only."""

    def names_configs(name) -> bool:
        return isinstance(name, str) and (name == "configs" or name.startswith("configs."))

    found = []
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            elif isinstance(node, ast.Constant):
                names = [node.value]  # import_module("configs.tiny"), root / "configs"
            else:
                continue
            if any(names_configs(n) for n in names):
                found.append(f"{module}:{node.lineno} reads configs")
    return found


def test_no_library_module_reads_configs():
    assert not configs_imports(SOURCES)
    for injected in (
        "from configs import tiny\n",
        "import configs.tiny\n",
        "def f():\n    from configs.tiny import get_config\n",
        "import importlib\nimportlib.import_module('configs.tiny')\n",
        "import pathlib\nBASE = pathlib.Path(__file__).parents[1] / 'configs' / 'base.py'\n",
    ):
        assert configs_imports({**SOURCES, "tree_grpo_jax.run.x": injected}) == [
            f"tree_grpo_jax.run.x:{injected.count(chr(10))} reads configs"
        ], injected
    # the package's own config modules and relative imports are not the folder
    own = "from tree_grpo_jax.config import schema\nfrom . import configs\nx = 'my_configs'\n"
    assert not configs_imports({"tree_grpo_jax.run.x": own})


def module_getattr_hooks(sources: dict[str, str]) -> list[str]:
    """Modules that define a module-level `__getattr__` (PEP 562): the hook that serves old
    names from a map of aliases, so that a moved module is found where it no longer is. A
    name lives in one place; code imports it from there."""
    found = []
    for module, text in sources.items():
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (
                node.name == "__getattr__"
            ):
                found.append(f"{module}:{node.lineno} defines a module __getattr__")
    return found


def test_no_module_serves_names_through_a_module_getattr():
    assert not module_getattr_hooks(SOURCES)
    injected = (
        "import importlib\n\n_MOVED = {'rollout': 'core.rollout'}\n\n\n"
        "def __getattr__(name):\n"
        "    return importlib.import_module(f'{__name__}.{_MOVED[name]}')\n"
    )
    assert module_getattr_hooks({**SOURCES, "tree_grpo_jax": injected}) == [
        "tree_grpo_jax:6 defines a module __getattr__"
    ]
    # a class's own __getattr__ is no module hook
    own = "class Lazy:\n    def __getattr__(self, name):\n        return name\n"
    assert not module_getattr_hooks({"tree_grpo_jax.run.x": own})


# The objectives' names and classes, read from the methods table: one added there is guarded
# here without an edit (the floor below sees a table that lost its objectives).
OBJECTIVE_NAMES = {objective.name for objective in methods.objectives()}
OBJECTIVE_CLASSES = {"Objective"} | {type(objective).__name__ for objective in methods.objectives()}


def _strings(node) -> set[str]:
    """The string constants `node` is or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def objective_branches(sources: dict[str, str]) -> list[str]:
    """Places outside `tree_grpo_jax.methods` that ask which objective a method has instead of
    calling it: `.forward_process`, a comparison with `.objective` or with an objective's
    name, an isinstance test against an objective's class."""
    found = []
    for module, text in sources.items():
        if module == "tree_grpo_jax.methods" or module.startswith("tree_grpo_jax.methods."):
            continue
        for node in ast.walk(ast.parse(text)):
            where = f"{module}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr == "forward_process":
                found.append(f"{where} reads .forward_process")
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(n, ast.Attribute) and n.attr == "objective" for n in sides):
                    found.append(f"{where} compares a method's objective")
                elif set().union(*map(_strings, sides)) & OBJECTIVE_NAMES:
                    found.append(f"{where} compares with an objective's name")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
                and _names(node.args[1]) & OBJECTIVE_CLASSES
            ):
                found.append(f"{where} tests an objective's class")
    return found


BENCHMARK_SOURCES = {
    f"benchmarks.{p.stem}": p.read_text() for p in (ROOT.parent / "benchmarks").glob("*.py")
}


def test_no_objective_branch_outside_the_methods_package():
    assert {"ppo", "nft", "awm", "dgpo", "dpo", "crd"} <= OBJECTIVE_NAMES
    assert {"PPOObjective", "NFTObjective", "AWMObjective", "DGPOObjective"} <= OBJECTIVE_CLASSES
    assert {"DPOObjective", "CRDObjective"} <= OBJECTIVE_CLASSES
    assert not objective_branches({**SOURCES, **BENCHMARK_SOURCES})
    # the methods package itself may: it is where an objective is chosen
    assert "tree_grpo_jax.methods.table" in SOURCES


def test_an_objective_branch_is_caught():
    injected = {
        "tree_grpo_jax.run.x": "if trainer.method.objective == 'nft':\n    pass\n",
        "tree_grpo_jax.run.y": "old = methods.get(name).forward_process\n",
        "tree_grpo_jax.run.z": "if kind in ('ppo', 'other'):\n    pass\n",
        "benchmarks.w": "if isinstance(m.objective, nft.NFTObjective):\n    pass\n",
        "tree_grpo_jax.run.v": "if name == 'nft':\n    pass\n",
        "tree_grpo_jax.run.s": "if kind != 'dgpo':\n    pass\n",
        "tree_grpo_jax.cli.t": "ok = isinstance(objective, awm.AWMObjective)\n",
    }
    found = objective_branches({**SOURCES, **injected})
    assert found == [
        "tree_grpo_jax.run.x:1 compares a method's objective",
        "tree_grpo_jax.run.y:1 reads .forward_process",
        "tree_grpo_jax.run.z:1 compares with an objective's name",
        "benchmarks.w:1 tests an objective's class",
        "tree_grpo_jax.run.v:1 compares with an objective's name",
        "tree_grpo_jax.run.s:1 compares with an objective's name",
        "tree_grpo_jax.cli.t:1 tests an objective's class",
    ]
    # the same text inside the methods package is its own business
    assert not objective_branches({"tree_grpo_jax.methods.table": injected["tree_grpo_jax.run.x"]})
    # a string that merely holds the name is no comparison
    assert not objective_branches({"tree_grpo_jax.run.u": "label = 'nft on the tree'\n"})


# diffusers 0.40 and transformers 5 removed their Flax classes: the package's networks are
# its own (`models.unet`, `models.autoencoder_kl`, `models.clip`, ...), under the same names.
UPSTREAM = ("diffusers", "transformers")


def upstream_flax_uses(sources: dict[str, str]) -> list[str]:
    """Imports of a `Flax*` name or a `*flax*` module of diffusers or transformers, and
    attribute uses such as `transformers.FlaxCLIPModel`."""
    found = []
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] in UPSTREAM]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UPSTREAM:
                names = [node.module] + [a.name for a in node.names]
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in UPSTREAM
            ):
                names = [node.attr]
            else:
                continue
            if any(n.startswith("Flax") or "flax" in n.split(".")[-1] for n in names):
                found.append(
                    f"{module}:{node.lineno} uses a Flax class of diffusers or transformers"
                )
    return found


def test_no_module_uses_a_flax_class_of_diffusers_or_transformers():
    assert not upstream_flax_uses(SOURCES)
    injected = {
        "tree_grpo_jax.rewards.a": "from transformers import FlaxCLIPTextModel\n",
        "tree_grpo_jax.models.b": (
            "def f():\n    from transformers.models.clip.modeling_flax_clip import CLIPConfig\n"
        ),
        "tree_grpo_jax.models.c": "import diffusers.models.attention_flax\n",
        "tree_grpo_jax.models.d": "import diffusers\nvae = diffusers.FlaxAutoencoderKL\n",
        "tree_grpo_jax.models.e": "from diffusers.models.unets.unet_2d_blocks_flax import X\n",
    }
    assert upstream_flax_uses(injected) == [
        "tree_grpo_jax.rewards.a:1 uses a Flax class of diffusers or transformers",
        "tree_grpo_jax.models.b:2 uses a Flax class of diffusers or transformers",
        "tree_grpo_jax.models.c:1 uses a Flax class of diffusers or transformers",
        "tree_grpo_jax.models.d:2 uses a Flax class of diffusers or transformers",
        "tree_grpo_jax.models.e:1 uses a Flax class of diffusers or transformers",
    ]
    # the package's own Flax models, flax itself and the libraries' configs are fine
    own = (
        "import flax.linen as nn\nfrom flax import serialization\n"
        "from tree_grpo_jax.models import clip, unet, autoencoder_kl\n"
        "from transformers import CLIPTextConfig\nimport diffusers\nx = diffusers.__version__\n"
    )
    assert not upstream_flax_uses({"tree_grpo_jax.models.f": own})
