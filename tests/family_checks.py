"""Steps the model families' end-to-end tests share: one training iteration of the package's
command line with torch blocked, its export, and a random LoRA exported for diffusers. Each
family's test keeps its own flags, references and tolerances."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA_RANK, LORA_ALPHA = 2, 4.0

# One small iteration that saves a checkpoint, in float32 so the export can be compared.
ONE_ITERATION = [
    "--config.model.compute_dtype=float32",
    "--config.model.remat=False",
    "--config.rewards=jpeg_compressibility",
    "--config.prompts.batch_size=1",
    "--config.prompts.eval_count=1",
    "--config.sampling.num_steps=3",
    "--config.train.iterations=1",
    "--config.train.grad_accumulation=1",
    "--config.train.learning_rate=1e-3",
    "--config.eval.every=0",
    "--config.checkpoint.every=1",
    "--config.log.tensorboard=False",
]


def train_one_iteration_without_torch(config, workdir, overrides, released):
    """`tree_grpo_jax.main` on `config` for one iteration into `workdir`, on the CPU in a
    process where torch cannot be imported; it must succeed, say `released` (its text encoder
    given back after encoding the prompts) and log a finite training loss."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # torch is a test-only dependency: loading, training and evaluating never import it.
    no_torch = (
        "import runpy, sys; sys.modules['torch'] = None; "
        "runpy.run_module('tree_grpo_jax.main', run_name='__main__')"
    )
    given = {flag.split("=")[0] for flag in overrides}  # an override replaces a default flag
    defaults = [flag for flag in ONE_ITERATION if flag.split("=")[0] not in given]
    flags = [f"--config={config}", f"--workdir={workdir}", *defaults, *overrides]
    run = subprocess.run(
        [sys.executable, "-c", no_torch, *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert released in run.stdout + run.stderr
    metrics = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in m and np.isfinite(m["train/loss"]) for m in metrics)


def export_the_trained_params(workdir, out, initial_params):
    """Exports the run in `workdir` to `out` and returns its trained params, checked to differ
    from `initial_params`."""
    from tree_grpo_jax.cli import export
    from tree_grpo_jax.run.checkpoint import Checkpointer

    assert export.main([f"--workdir={workdir}", f"--out={out}"]) == 0
    trained = Checkpointer(str(workdir / "checkpoints"), read_only=True).restore_params()
    changed = jax.tree_util.tree_map(
        lambda a, b: float(jnp.abs(a - b).max()), trained, initial_params
    )
    assert max(jax.tree_util.tree_leaves(changed)) > 0  # the iteration moved the weights
    return trained


def random_lora(params, paths):
    """Rank-2 LoRA factors on `paths` of `params` with both A and B random."""
    from tree_grpo_jax import lora

    factors = lora.init_lora(jax.random.PRNGKey(0), params, paths, rank=LORA_RANK)
    # B starts at zero (PEFT's init); give it values so the adapter changes the output.
    return jax.tree_util.tree_map(
        lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(1), x.shape), factors
    )


def export_lora(factors, family, folder, **options):
    """`factors` saved in diffusers' LoRA format for `family`'s component; the folder."""
    from tree_grpo_jax import lora

    return lora.export_lora(
        factors, family.export.component, LORA_RANK, LORA_ALPHA, folder, **options
    )


def merged(params, factors):
    """`params` with the adapter `factors` folded in, as the pipeline applies them."""
    from tree_grpo_jax import lora

    return lora.merge(params, factors, LORA_ALPHA, LORA_RANK)


def with_lora_loaded(pipe, lora_folder, compute):
    """`compute(pipe.transformer)` while the pipeline holds the LoRA in `lora_folder`."""
    pipe.load_lora_weights(str(lora_folder))
    try:
        return compute(pipe.transformer)
    finally:
        pipe.unload_lora_weights()


def random_velocity_inputs(seed, sample_shape, text_width, lengths, sigmas):
    """Latents [len(lengths), *sample_shape], prompt states of the given lengths and the
    sigmas, random from `seed`, for a denoiser that takes per-prompt text states."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(lengths), *sample_shape)).astype("f4")
    embeds = [rng.standard_normal((n, text_width)).astype("f4") for n in lengths]
    return x, embeds, np.array(sigmas, "f4")
