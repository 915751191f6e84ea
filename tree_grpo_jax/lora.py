"""Parameter-level LoRA: low-rank factors added to chosen Dense kernels of a frozen base.

A Flax Dense kernel W is [in, out] (y = x @ W). Its adapter holds `a` [in, rank] and `b`
[rank, out], and the model runs with W + (alpha / rank) * a @ b: exactly what PEFT's
`lora.Linear` computes unmerged (y = x W^T + (alpha / r) * B(A(x)) in PyTorch layout, with
`lora_A.weight` = a^T and `lora_B.weight` = b^T). Merging before the forward keeps the
model code untouched; training differentiates through `merge` with respect to the factors
only, so the optimizer state and the checkpoints hold the factors and nothing else.

The adapter tree mirrors the module paths of the params it adapts:
`{"down_blocks_0": {..., "to_q": {"a": ..., "b": ...}}}`. A model that scans its identical
blocks (`weights.stacking`) holds their kernels stacked, [layers, in, out]; their factors
are stacked alike, `a` [layers, in, rank] and `b` [layers, rank, out]. Targets are matched,
factors drawn and PEFT keys written for the blocks one by one, so a scanned model's adapter
is the unscanned one's, stacked.

`to_peft_state_dict` and `save_peft` write `pytorch_lora_weights.safetensors` as diffusers'
`pipe.load_lora_weights(folder)` reads it (keys `unet.<module>.lora_A.weight` /
`transformer.<module>.lora_B.weight`); rank and alpha travel in the file's
`lora_adapter_metadata`, the JSON `LoraConfig` arguments diffusers (>= 0.34) passes to PEFT.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from tree_grpo_jax.weights import convert, stacking
from tree_grpo_jax.weights.files import unwrap_params
from tree_grpo_jax.weights.low_rank import ATTACHED, Attached, merged_kernel
from tree_grpo_jax.weights.staging import CARD_FILE, check_out_dir, new_file_mode, write_staged

KeyPath = tuple[str, ...]

LORA_FILE = "pytorch_lora_weights.safetensors"  # the name `load_lora_weights(folder)` reads
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
_FACTORS = ("a", "b")
_PEFT_LEAVES = {"lora_A.weight": "a", "lora_B.weight": "b"}


# ---------------------------------------------------------------------------------------------
# Which kernels.


def _parse_target(target: str) -> KeyPath:
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"LoRA target {target!r} is not a module name.")
    if "." in target:
        raise ValueError(
            f"LoRA target {target!r} has a '.'; write Flax module names joined by '/' "
            "(e.g. 'to_out_0' for PyTorch's 'to_out.0', 'attn/to_q' for 'attn.to_q')."
        )
    segments = tuple(target.strip().split("/"))
    if not all(segments):
        raise ValueError(f"LoRA target {target!r} has an empty path segment.")
    return segments


def _matches(module: KeyPath, pattern: KeyPath) -> bool:
    if len(pattern) > len(module):
        return False
    tail = module[len(module) - len(pattern) :]
    return all(fnmatch.fnmatchcase(name, pat) for name, pat in zip(tail, pattern))


def _run(path: KeyPath) -> tuple[int, list[str]]:
    """(where, blocks): the segment of a leaf's module path that names a scanned run and the
    per-block names it stands for; (0, [path[0]]) when none does. The run is the top level's
    in a denoiser's params, or one level down where the params hold several denoisers (a
    pipeline's two experts, `{"transformer": ..., "transformer_2": ...}`)."""
    for where, name in enumerate(path[:-1]):
        blocks = stacking.block_names(name)
        if len(blocks) > 1:
            return where, blocks
    return 0, [path[0]]


def _in_block(path: KeyPath, where: int, block: str) -> KeyPath:
    return (*path[:where], block, *path[where + 1 :])


def _unstacked_like(lora, base_params):
    """`lora` with each scanned run unstacked where `base_params` holds that run block by
    block (a base read from a folder), at the top level or one level down."""
    if stacking.is_stacked(lora) and not stacking.is_stacked(base_params):
        return stacking.unstack(lora)
    parts = {
        name: stacking.unstack(part)
        for name, part in lora.items()
        if isinstance(part, Mapping)
        and stacking.is_stacked(part)
        and isinstance(base_params.get(name), Mapping)
        and not stacking.is_stacked(base_params[name])
    }
    return {**lora, **parts} if parts else lora


def _shape(leaf) -> tuple[int, ...]:
    return tuple(leaf.shape) if hasattr(leaf, "shape") else np.shape(leaf)


def target_paths(params, targets: str | Sequence[str]) -> tuple[KeyPath, ...]:
    """The paths of the 2-D `kernel` leaves (Dense layers) whose module matches a target.

    A target is matched against the end of the module path, segment by segment, as PEFT
    matches `target_modules` against the end of PyTorch module names: "to_q" selects every
    module named `to_q`, "attn/to_q" only those directly inside a module named `attn`,
    "transformer_blocks_*/attn/to_q" those in any joint block. Within a segment `*`, `?` and
    `[...]` are shell wildcards (`fnmatch`); a wildcard never spans a "/". Names are the
    Flax ones ("to_out_0", not "to_out.0"). Conv kernels (4-D) are never selected.
    Returns the paths sorted; raises ValueError when nothing matches.
    """
    if isinstance(targets, str):
        targets = (targets,)
    patterns = [_parse_target(t) for t in targets]
    if not patterns:
        raise ValueError("LoRA needs at least one target module name.")
    selected = []
    for path, leaf in flatten_dict(dict(params)).items():
        where, blocks = _run(path)
        if path[-1] != "kernel" or len(_shape(leaf)) != (3 if len(blocks) > 1 else 2):
            continue
        # A stacked kernel is chosen when the targets choose it in every block of its run.
        chosen = [
            any(_matches(_in_block(path, where, b)[:-1], p) for p in patterns) for b in blocks
        ]
        if all(chosen):
            selected.append(path)
        elif any(chosen):
            raise ValueError(
                f"the LoRA targets {', '.join(targets)} choose {'/'.join(path[where + 1 : -1])} "
                f"in some of the scanned blocks {path[where]} but not all; set "
                "--config.model.scan_layers=False to adapt single blocks."
            )
    if not selected:
        raise ValueError(
            f"no 2-D Dense kernel in the params belongs to a module matching the LoRA targets "
            f"{', '.join(targets)} (Flax module names or '/'-joined path endings such as "
            "'attn/to_q')."
        )
    return tuple(sorted(selected))


# ---------------------------------------------------------------------------------------------
# The factors.


def _check_rank(rank) -> int:
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}.")
    return int(rank)


def _check_alpha(alpha) -> float:
    if not isinstance(alpha, (int, float, np.number)) or not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"LoRA alpha must be a positive number, got {alpha!r}.")
    return float(alpha)


def _leaf(tree, path: KeyPath):
    node = tree
    for name in path:
        if not isinstance(node, Mapping) or name not in node:
            raise ValueError(f"the params have no leaf {'/'.join(path)} to put LoRA on.")
        node = node[name]
    return node


def _replace(tree, path: KeyPath, value):
    """`tree` with the leaf at `path` replaced (or added); only the dicts along the path are
    copied."""
    if not path:
        return value
    node = dict(tree)
    node[path[0]] = _replace(tree.get(path[0], {}), path[1:], value)
    return node


def _factor_pairs(lora) -> dict[KeyPath, tuple]:
    """{module path: (a, b)} of an adapter tree; raises ValueError if it is malformed."""
    flat = flatten_dict(dict(lora))
    modules: dict[KeyPath, dict] = {}
    for path, value in flat.items():
        if path[-1] not in _FACTORS:
            raise ValueError(f"LoRA leaf {'/'.join(path)} is neither an `a` nor a `b` factor.")
        modules.setdefault(path[:-1], {})[path[-1]] = value
    for module, factors in modules.items():
        if set(factors) != set(_FACTORS):
            raise ValueError(f"LoRA module {'/'.join(module)} needs both an `a` and a `b`.")
    if not modules:
        raise ValueError("the LoRA tree holds no factors.")
    return {m: (f["a"], f["b"]) for m, f in sorted(modules.items())}


def init_lora(key: jax.Array, params, paths: Sequence[KeyPath], rank: int) -> dict:
    """Fresh float32 factors for the kernels at `paths`, as PEFT initialises them.

    `a` [in, rank] is uniform in +-1/sqrt(in) (PEFT's lora_A: kaiming-uniform with
    a=sqrt(5), torch's nn.Linear default) and `b` [rank, out] is zero, so the merged model
    is the base model until the first update. Each path draws from its own split of `key`,
    in the order given. A stacked kernel (a scanned run of blocks) has a stacked `a` and
    `b`; then every block draws as its own path, in the sorted order of the per-block
    paths, which gives the factors of the unscanned model's `target_paths` (sorted).
    """
    rank = _check_rank(rank)
    if not paths:
        raise ValueError("LoRA needs at least one kernel path.")
    kernels = {}
    for path in paths:
        path = tuple(path)
        kernel = _leaf(params, path)
        where, blocks = _run(path)
        stacked = len(blocks) > 1
        if len(_shape(kernel)) != 2 + stacked:
            raise ValueError(
                f"LoRA goes on 2-D Dense kernels, but {'/'.join(path)} has shape "
                f"{tuple(kernel.shape)}."
            )
        # A stacked kernel's blocks, one by one, as an unscanned model names them.
        for position, block in enumerate(blocks):
            kernels[_in_block(path, where, block)] = (path, position if stacked else None)
    flat, drawn = {}, {}
    order = sorted(kernels) if any(p is not None for _, p in kernels.values()) else kernels
    for subkey, block_path in zip(jax.random.split(key, len(kernels)), order):
        path, position = kernels[block_path]
        fan_in, fan_out = _shape(_leaf(params, path))[-2:]
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(subkey, (fan_in, rank), jnp.float32, -bound, bound)
        drawn.setdefault(path, {})[position] = a
        if len(drawn[path]) == len(_run(path)[1]):
            module, factors = path[:-1], drawn.pop(path)
            if position is None:  # a kernel of one block
                flat[module + ("a",)] = a
                flat[module + ("b",)] = jnp.zeros((rank, fan_out), jnp.float32)
            else:
                flat[module + ("a",)] = jnp.stack([factors[i] for i in range(len(factors))])
                flat[module + ("b",)] = jnp.zeros((len(factors), rank, fan_out), jnp.float32)
    return unflatten_dict(flat)


def merge(base_params, lora, alpha: float, rank: int):
    """The base params with W + (alpha / rank) * a @ b at every adapted kernel.

    The sum is taken in (at least) float32 at full matmul precision and cast back to W's
    dtype, so a bfloat16 base stays bfloat16 and zero `b` factors give the base bit for bit
    (a weight of -0.0 may come back as +0.0). Every other leaf is the base's own. Jittable
    (`alpha` may be traced, `rank` is static) and differentiable with respect to `lora`.
    """
    rank = _check_rank(rank)
    scale = alpha / rank
    lora = _unstacked_like(lora, base_params)  # a scanned run's factors on a base read by block
    merged = base_params
    for module, (a, b) in _factor_pairs(lora).items():
        path = module + ("kernel",)
        kernel = _leaf(base_params, path)
        _check_factors(kernel, a, b, rank)
        merged = _replace(merged, path, merged_kernel(kernel, a, b, scale))
    return merged


def _check_factors(kernel, a, b, rank: int) -> None:
    layers = kernel.shape[:-2]  # (layers,) for a scanned run's stacked kernel
    chex.assert_shape(a, (*layers, kernel.shape[-2], rank))
    chex.assert_shape(b, (*layers, rank, kernel.shape[-1]))


# ---------------------------------------------------------------------------------------------
# Merging one block at a time.
#
# Merged up front, the adapted weights are a second copy of the base's kernels (22 GB for
# FLUX.1 in bfloat16) beside the frozen base; a scanned run merges one block at a time
# instead (`weights.low_rank`).


def attach(base_params, lora, alpha: float, rank: int):
    """The denoiser's weights for `lora` on `base_params`, the same function as `merge`
    computes: each adapted kernel of a scanned run (stacked) keeps the base's array and
    carries its factors (`Attached` under `ATTACHED` in its module), merged block by block
    inside the scan (`low_rank.merge_attached`); any other adapted kernel is merged now
    (jitted, as `Adapter.merged` merges). Every other leaf is the base's own. `alpha` and
    `rank` are static."""
    rank = _check_rank(rank)
    lora = _unstacked_like(lora, base_params)  # a scanned run's factors on a base read by block
    pairs = _factor_pairs(lora)
    scanned = {m: f for m, f in pairs.items() if _in_scanned_run(m)}
    now = {m + (n,): x for m, f in pairs.items() if m not in scanned for n, x in zip(_FACTORS, f)}
    weights = base_params
    if now:  # only these kernels go through the jitted merge (it copies what it returns)
        paths = [m[:-1] + ("kernel",) for m in now if m[-1] == "a"]
        kernels = unflatten_dict({p: _leaf(base_params, p) for p in paths})
        merged = _merged(kernels, unflatten_dict(now), alpha, rank)
        for path in paths:
            weights = _replace(weights, path, _leaf(merged, path))
    for module, (a, b) in scanned.items():
        path = module + ("kernel",)
        _check_factors(_leaf(base_params, path), a, b, rank)
        weights = _replace(weights, module + (ATTACHED,), Attached(a, b, alpha / rank))
    return weights


def _in_scanned_run(path: KeyPath) -> bool:
    return len(_run((*path, "kernel"))[1]) > 1


# ---------------------------------------------------------------------------------------------
# The trainer's adapter.


@dataclasses.dataclass(frozen=True, eq=False)
class Adapter:
    """LoRA: the trainer's params are low-rank factors on these frozen base weights."""

    base: Any  # the model's denoiser weights, on the mesh, never updated
    paths: tuple  # the adapted kernels
    rank: int
    alpha: float
    base_fingerprint: str  # a checksum of `base`: a resume must find the same weights

    def merged(self, factors):
        return _merged(self.base, factors, self.alpha, self.rank)

    def weights(self, factors):
        """The denoiser's weights for `factors`, merged block by block in scanned runs
        (`attach`): what the rollout and the evaluation sample with."""
        return attach(self.base, factors, self.alpha, self.rank)

    def merged_up_front(self, factors) -> tuple[list, list]:
        """(base kernels, their factors) that `weights` merges up front (outside scanned
        runs): the sampling programs take merged copies of them, and the run keeps these
        beside. Every other base array and factor is passed in as it is."""
        paths = [p for p in self.paths if not _in_scanned_run(p)]
        pairs = [_leaf(factors, p[:-1] + (n,)) for p in paths for n in _FACTORS]
        return [_leaf(self.base, p) for p in paths], pairs


@functools.partial(jax.jit, static_argnums=(2, 3))
def _merged(base, factors, alpha, rank):
    return merge(base, factors, alpha, rank)


def weights_fingerprint(params) -> str:
    """A cheap checksum of a params tree: its paths, shapes and a few sums per leaf, taken
    block by block (the same for a scanned model's stacked blocks)."""
    digest = hashlib.sha256()
    blocks = stacking.unstack(jax.device_get(params))
    for path, leaf in sorted(flatten_dict(blocks).items()):
        x = np.asarray(leaf, np.float64)
        digest.update("/".join(map(str, path)).encode())
        digest.update(str(x.shape).encode())
        digest.update(
            np.asarray(
                [x.sum(), np.abs(x).sum(), x.ravel()[:: max(1, x.size // 7)].sum()]
            ).tobytes()
        )
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Counting.


def count_params(tree) -> int:
    """The number of scalars in a tree of arrays (or `jax.eval_shape` structs)."""
    return sum(math.prod(_shape(leaf)) for leaf in jax.tree_util.tree_leaves(tree))


def lora_summary(params, paths: Sequence[KeyPath], rank: int) -> tuple[int, int]:
    """(trainable LoRA scalars, base scalars) for LoRA of `rank` at `paths`, from shapes."""
    rank = _check_rank(rank)
    trainable = 0
    for path in paths:
        *layers, fan_in, fan_out = _shape(_leaf(params, tuple(path)))
        trainable += math.prod(layers) * rank * (fan_in + fan_out)
    return trainable, count_params(params)


# ---------------------------------------------------------------------------------------------
# PEFT / diffusers files.


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix or "." in prefix:
        raise ValueError(f"the PEFT key prefix must be one name like 'unet', got {prefix!r}.")
    return prefix


def to_peft_state_dict(
    lora, alpha: float, rank: int, prefix: str, list_names: frozenset | None = None
) -> dict[str, np.ndarray]:
    """The factors as PEFT names them in diffusers' LoRA files, float32, PyTorch layout.

    Keys are `<prefix>.<module>.lora_A.weight` [rank, in] and `.lora_B.weight` [out, rank],
    the module in diffusers' PyTorch spelling (`down_blocks.0....to_out.0`); `prefix` is
    "unet" for SD1.5 and "transformer" for SD3. The tensors are the factors unscaled:
    alpha is not in them but in the metadata `save_peft` writes (diffusers reads it there),
    so `alpha` and `rank` are only checked here. `list_names`: the model's module lists
    (Flax `name_N` is PyTorch `name.N`), the family export's (None: diffusers' usual ones).
    """
    _check_alpha(alpha)
    rank = _check_rank(rank)
    prefix = _check_prefix(prefix)
    flat = {}
    for module, (a, b) in _factor_pairs(stacking.unstack(jax.device_get(lora))).items():
        chex.assert_rank([a, b], 2)
        chex.assert_axis_dimension(a, 1, rank)
        chex.assert_axis_dimension(b, 0, rank)
        flat[module + ("lora_A", "kernel")] = np.asarray(a, np.float32)
        flat[module + ("lora_B", "kernel")] = np.asarray(b, np.float32)
    # A kernel [in, out] becomes weight [out, in]: a -> lora_A [rank, in], b -> lora_B [out, rank].
    names = convert.DIFFUSERS_LIST_NAMES if list_names is None else list_names
    state = convert.flax_to_pytorch(unflatten_dict(flat), list_names=names)
    return {f"{prefix}.{key}": value for key, value in state.items()}


def _split_key(key: str) -> tuple[str, str, str]:
    """`prefix.module.lora_A.weight` -> (prefix, module, "a")."""
    for suffix, factor in _PEFT_LEAVES.items():
        if key.endswith("." + suffix):
            head = key[: -len(suffix) - 1]
            prefix, _, module = head.partition(".")
            if prefix and module:
                return prefix, module, factor
    raise ValueError(
        f"{key!r} is not a PEFT LoRA key like 'unet.<module>.lora_A.weight' "
        "(biases and DoRA magnitudes are not supported)."
    )


def _peft_modules(state_dict: Mapping[str, np.ndarray]) -> dict[str, dict[str, dict]]:
    """{prefix: {module: {"a": lora_A.weight, "b": lora_B.weight}}}, each pair complete."""
    grouped: dict[str, dict[str, dict]] = {}
    for key, value in state_dict.items():
        prefix, module, factor = _split_key(key)
        grouped.setdefault(prefix, {}).setdefault(module, {})[factor] = value
    for prefix, modules in grouped.items():
        for module, factors in modules.items():
            if set(factors) != set(_FACTORS):
                raise ValueError(
                    f"LoRA module {prefix}.{module} needs both lora_A.weight and lora_B.weight."
                )
    return grouped


def _json_number(x: float):
    return int(x) if float(x).is_integer() else float(x)


def save_peft(path, state_dict: Mapping[str, np.ndarray], alpha: float, rank: int) -> Path:
    """Writes a `to_peft_state_dict` result as a safetensors file diffusers loads.

    `path` is the file, or a folder to hold `pytorch_lora_weights.safetensors` (the name
    `pipe.load_lora_weights(folder)` looks for). Next to `format: pt`, the header's
    `lora_adapter_metadata` holds, per key prefix, the `LoraConfig` arguments diffusers
    0.34+ hands to PEFT instead of guessing them: `<prefix>.r`, `<prefix>.lora_alpha`,
    `<prefix>.target_modules` (the adapted modules' full names), empty rank and alpha
    patterns. Without that metadata a loader takes lora_alpha = r. Returns the file's path.
    """
    alpha = _check_alpha(alpha)
    rank = _check_rank(rank)
    path = Path(path).expanduser()
    file = path if path.suffix == ".safetensors" else path / LORA_FILE
    grouped = _peft_modules(state_dict)
    if not grouped:
        raise ValueError("the LoRA state dict to save is empty.")
    config = {}
    for prefix, modules in grouped.items():
        for module, factors in modules.items():
            a, b = np.shape(factors["a"]), np.shape(factors["b"])
            if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
                raise ValueError(
                    f"{prefix}.{module} has lora_A {a} and lora_B {b}, not [{rank}, in] and "
                    f"[out, {rank}]."
                )
        config.update(
            {
                f"{prefix}.r": rank,
                f"{prefix}.lora_alpha": _json_number(alpha),
                f"{prefix}.target_modules": sorted(modules),
                f"{prefix}.rank_pattern": {},
                f"{prefix}.alpha_pattern": {},
            }
        )
    tensors = {}
    for key, value in state_dict.items():
        value = np.asarray(value)
        if value.dtype not in (np.float16, np.float32, np.float64):
            value = value.astype(np.float32)  # e.g. bfloat16, which numpy files cannot hold
        tensors[key] = np.ascontiguousarray(value)
    metadata = {"format": "pt", METADATA_KEY: json.dumps(config, indent=2, sort_keys=True)}

    from safetensors.numpy import save_file

    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_name(f".{file.name}.partial-{os.getpid()}")
    try:
        save_file(tensors, str(partial), metadata=metadata)
        os.replace(partial, file)
    finally:
        partial.unlink(missing_ok=True)
    return file


def _flax_module(pt_module: str) -> KeyPath:
    """`down_blocks.0.attn1.to_out.0` -> ("down_blocks_0", "attn1", "to_out_0"): diffusers'
    PyTorch module lists are `name_N` in the Flax trees."""
    merged: list[str] = []
    for part in pt_module.split("."):
        if part.isdigit() and merged:
            merged[-1] = f"{merged[-1]}_{part}"
        else:
            merged.append(part)
    return tuple(merged)


def from_peft_state_dict(state_dict: Mapping[str, np.ndarray], prefix: str) -> dict:
    """The adapter tree (float32) of the `prefix.` keys of a PEFT LoRA state dict; the
    inverse of `to_peft_state_dict`. Keys under other prefixes are ignored."""
    prefix = _check_prefix(prefix)
    ours = {k: v for k, v in state_dict.items() if k.startswith(prefix + ".")}
    modules = _peft_modules(ours).get(prefix)
    if not modules:
        raise ValueError(f"the LoRA state dict has no {prefix}.* keys.")
    flat = {}
    for module, factors in modules.items():
        a, b = np.asarray(factors["a"], np.float32), np.asarray(factors["b"], np.float32)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{prefix}.{module} has lora_A {a.shape} and lora_B {b.shape}, which do not "
                "make a low-rank pair."
            )
        flax_module = _flax_module(module)
        flat[flax_module + ("a",)] = jnp.asarray(a.T)
        flat[flax_module + ("b",)] = jnp.asarray(b.T)
    return unflatten_dict(flat)


def read_peft(path, prefix: str) -> tuple[dict, float, int]:
    """(adapter tree, alpha, rank) of a PEFT LoRA safetensors file (or a folder holding
    `pytorch_lora_weights.safetensors`); alpha is rank when the file has no metadata, as
    diffusers assumes."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    prefix = _check_prefix(prefix)
    path = Path(path).expanduser()
    file = path if path.suffix == ".safetensors" else path / LORA_FILE
    with safe_open(str(file), framework="np") as f:
        header = f.metadata() or {}
    state = load_file(str(file))
    lora = from_peft_state_dict(state, prefix)
    ranks = {pair[0].shape[1] for pair in _factor_pairs(lora).values()}
    if len(ranks) != 1:
        raise ValueError(f"{file} mixes LoRA ranks {sorted(ranks)}, which is not supported.")
    rank = ranks.pop()
    config = json.loads(header[METADATA_KEY]) if header.get(METADATA_KEY) else {}
    if config.get(f"{prefix}.r", rank) != rank:
        raise ValueError(f"{file} says r={config[f'{prefix}.r']} but its factors have rank {rank}.")
    alpha = float(config.get(f"{prefix}.lora_alpha", rank))
    return lora, alpha, int(rank)


def export_lora(
    factors,
    prefix: str,
    rank: int,
    alpha: float,
    out_dir,
    overwrite=False,
    sources=(),
    card: str | None = None,
    list_names: frozenset | None = None,
) -> Path:
    """`<out>/pytorch_lora_weights.safetensors` from LoRA factors, in the key format
    diffusers' `load_lora_weights` reads (`prefix`: the family's, e.g. "unet"), with `card`
    (a model card) as `<out>/README.md`; written to a staging folder and moved into place.
    `list_names`: the model's module lists (the family export's)."""
    out = Path(out_dir).expanduser()
    check_out_dir(None, out, overwrite, sources)
    factors = unwrap_params(factors)
    if isinstance(factors, dict) and prefix in factors:
        # One tree per component (a pipeline's two experts): one PEFT file holds one.
        raise ValueError(
            f"the LoRA factors hold {', '.join(sorted(factors))}, one adapter per component; "
            "one PEFT file holds one component's, so export them merged (--merge)."
        )
    state = to_peft_state_dict(jax.device_get(factors), alpha, rank, prefix, list_names)

    def fill(staging: Path) -> None:
        weights = save_peft(staging / LORA_FILE, state, alpha, rank)
        os.chmod(weights, new_file_mode(staging))  # safetensors writes 0600 files
        if card is not None:
            (staging / CARD_FILE).write_text(card, encoding="utf-8")

    return write_staged(out, fill)
