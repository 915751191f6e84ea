"""The run's evaluation: fixed prompts, fixed noise and the deterministic sampler.

An `Evaluator` is built beside the `Trainer` (`build.setup`) and held by it; it shares the
trainer's model, mesh, sampling denoiser, decoder and stored programs, and owns what only
the evaluation reads: the eval prompts and their metadata, the held-out rewards, the
diversity embedding and the eval KL's reference. Rows are sample-major (row k * P + p:
prompt p's k-th noise); the noise depends only on `eval.seed`, so every evaluation of a run
(and of its resumes) samples the same trajectories.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tree_grpo_jax import lora, sharding
from tree_grpo_jax.core import rollout
from tree_grpo_jax.evaluation import diversity
from tree_grpo_jax.models.base import TextToImageModel, schedule_for
from tree_grpo_jax.run import eval_metrics, input_images, reporting, scoring


@dataclasses.dataclass(frozen=True, eq=False)
class Evaluator:
    """Everything an evaluation needs; the same for every evaluation of a run."""

    config: ml_collections.ConfigDict
    workdir: str
    model: TextToImageModel
    mesh: Any
    reward: Any  # the trained reward: every sample's `reward_mean`
    rewards: dict  # the held-out ones (`eval.extra_rewards`), by name
    prompts: list[str]
    uncond: jax.Array | None
    denoise: Any  # the sampler's denoiser (the rollout's: `run.denoiser.sampling_denoise`)
    decode: Callable  # latents -> images, each device its own rows (`scoring.shared_decode`)
    adapter: lora.Adapter | None = None  # LoRA: the frozen base the trained factors adapt
    # each of `prompts`' metadata, in their order (the fields its prompt file gives beside the
    # prompt; {} each for a text file or a built-in set)
    metadata: tuple = ()
    embed: Any = None  # images -> [B, D]: the diversity measure's embedding (diversity.py)
    # videos [B, T, ...] -> [B, T, D]: the same embedding, frame by frame (the temporal
    # distance, evaluation/temporal.py); None for images
    frame_embed: Any = None
    # the denoiser's weights the eval KL compares with (the base for LoRA); None: no eval KL
    kl_reference: Any = None
    # programs made ahead, run in place of tracing them: the trainer's (`run.program_store`)
    programs: dict = dataclasses.field(default_factory=dict)

    def model_params(self, params):
        """The denoiser's weights for the trained `params` (see `Trainer.model_params`)."""
        return params if self.adapter is None else self.adapter.weights(params)

    def schedule(self):
        """The deterministic sampler's schedule: `eval.num_steps`, else the rollout's."""
        s, steps = self.config.sampling, self.config.eval.num_steps
        field = "eval.num_steps" if steps else "sampling.num_steps"
        return schedule_for(self.model, steps or s.num_steps, s, field)

    def inputs(self) -> tuple[list[str], np.ndarray]:
        """The fixed eval prompts (`eval.samples_per_prompt` rounds of them) and noise."""
        k = self.config.eval.samples_per_prompt
        prompts = list(self.prompts) * k
        return prompts, eval_metrics.eval_noise(
            self.config.eval.seed, len(prompts), self.model.sample_shape
        )

    def batch(self, params, prompts: Sequence[str], noise, with_kl: bool = False, metadata=None):
        """The deterministic sampler's images of `prompts` from `noise` [N, *S], decoded.

        The batch is topped up with repeats to a multiple of the devices it splits over;
        every device samples its share and every process decodes its own rows. `with_kl`
        also measures the exact KL of every sample's trajectory to `kl_reference`.
        `metadata` (one per prompt) travels with the rows to the rewards that take it."""
        count = len(prompts)
        if with_kl and self.kl_reference is None:
            raise ValueError("the eval KL needs a reference; this trainer keeps none.")
        rows, mine, args = self.sampler_args(prompts, noise, metadata)
        outputs = self.sampler_program(self.model_params(params), args, with_kl)
        kl = None
        if with_kl:
            samples, kl = outputs
            if sharding.multi_process():
                kl = sharding.local_rows(kl, rows)
            kl = sharding.gather(np.asarray(kl, np.float64))[:count]
        else:
            samples = outputs
        if sharding.multi_process():
            samples = sharding.local_rows(samples, rows)
        if not sharding.agree(bool(jnp.all(jnp.isfinite(samples))), "min"):
            raise scoring.DivergenceError.in_run("the evaluation samples", self.workdir)
        mine_metadata = None if metadata is None else [metadata[i] for i in mine]
        on_host = self.reward.on_host or any(r.on_host for r in self.rewards.values())
        groups = sharding.num_batch_shards(self.mesh) // jax.process_count()  # local devices
        parts = scoring.decode_parts(self.config.reward_options, on_host)
        images = scoring.decode(self.decode, samples, groups, parts)
        return eval_metrics.EvalSamples(
            images, [prompts[i] for i in mine], count, kl, mine_metadata
        )

    def inputs_metadata(self) -> list | None:
        """The metadata of `inputs()`' prompts, in their order (None: none known)."""
        return list(self.metadata) * self.config.eval.samples_per_prompt if self.metadata else None

    def sampler_args(
        self, prompts: Sequence[str], noise, metadata=None
    ) -> tuple[slice, np.ndarray, tuple]:
        """This process's rows of the eval batch padded to a multiple of the devices, the
        index of each of them in `prompts`, and the sampler's arguments after the weights.
        `metadata` (one per prompt) carries the input images of a family conditioning on
        them."""
        count = len(prompts)
        shards = sharding.num_batch_shards(self.mesh)
        padded = np.arange(-(-count // shards) * shards) % count
        rows = sharding.process_rows(len(padded))
        mine = padded[rows]
        mine_prompts = [prompts[i] for i in mine]
        mine_metadata = None if metadata is None else [metadata[i] for i in mine]
        cond = input_images.encode_prompts(self.model, mine_prompts, mine_metadata)
        args = (
            sharding.global_batch(self.mesh, cond),
            sharding.global_batch(self.mesh, np.asarray(noise)[mine]),
            self.schedule(),
            self.uncond,
            self.config.sampling.guidance_scale,
        )
        return rows, mine, args

    def sampler_program(
        self, weights, args: tuple, with_kl: bool, lower: bool = False, export: bool = False
    ):
        """The sampler (with the KL to `kl_reference` when `with_kl`) on `weights` and
        `args` (`sampler_args`): run, or lowered, or exported (the program store's)."""
        program = None if export else self.programs.get("evaluate")
        if with_kl:
            if program is not None:
                return (program.lower if lower else program)(weights, self.kl_reference, *args)
            fn = rollout.staged(rollout.sample_with_kl, lower, export)
            return fn(self.denoise, weights, self.kl_reference, *args)
        cond, noise, schedule, uncond, scale = args
        return rollout.sample_deterministic(
            self.denoise,
            weights,
            cond,
            noise,
            schedule,
            uncond=uncond,
            guidance_scale=scale,
            lower=lower,
            export=export,
            program=program,
        )

    def evaluate(self, params) -> tuple[dict, np.ndarray]:
        """Rewards, held-out metrics, diversity and (when kept) the KL to the reference of
        fixed prompts, `eval.samples_per_prompt` fixed noises each, with the deterministic
        sampler; for videos also the reward frame by frame and the temporal distance. Rows
        are sample-major (row k * P + p: prompt p's k-th noise)."""
        metrics, images, _, _ = self.evaluate_samples(params)
        return metrics, images

    def evaluate_samples(self, params) -> tuple[dict, np.ndarray, np.ndarray, list[str]]:
        """`evaluate`, with each image's reward and prompt. A prompt's samples, for the
        diversity, are all the rows with its text (`eval_metrics.measure` measures them as
        the evaluate command does)."""
        prompts, noise = self.inputs()
        with_kl = self.kl_reference is not None
        groups = diversity.groups_by_text(prompts)
        metadata = self.inputs_metadata()
        with scoring.reward_failures():  # a held-out reward served over HTTP
            measured = eval_metrics.measure(self, params, prompts, noise, groups, with_kl, metadata)
        batch = measured.samples
        total, parts, frames = scoring.score(
            self.reward, batch.decoded, batch.prompts, "in evaluation", batch.metadata
        )
        total, parts = total[: batch.count], {n: v[: batch.count] for n, v in parts.items()}
        metrics = {"reward_mean": float(total.mean()), "reward_std": float(total.std())}
        if len(parts) > 1:
            metrics.update({f"reward_{n}": float(v.mean()) for n, v in parts.items()})
        metrics.update(reporting.frame_rewards(None if frames is None else frames[: batch.count]))
        metrics.update({name: float(np.mean(v)) for name, v in measured.metrics.items()})
        if measured.temporal_distance is not None:
            metrics["temporal_distance"] = float(measured.temporal_distance.mean())
        if measured.diversity is not None:
            metrics["diversity"] = float(np.mean(measured.diversity))
        if with_kl:
            metrics["kl"] = float(measured.kl.mean())
        return metrics, batch.all_images(), total, prompts
