"""The settings a comparison shares and the config of each preset under them."""

from __future__ import annotations

import dataclasses

from benchmarks.common import FLOW_PRESETS, PRESETS, standin_model
from tree_grpo_jax.models.base import TextToImageModel
from tree_grpo_jax.plan import time_plan


@dataclasses.dataclass(frozen=True)
class Settings:
    """The run settings shared by every preset of a comparison."""

    # "tiny" (the shipped DDIM model), "tiny_flow" (its rectified-flow twin), "random_tiny"
    # or "standin"
    model: str = "tiny"
    num_steps: int = 10
    prompts: int = 4  # prompts per iteration; every preset has 16 leaves per prompt
    guidance_scale: float = 1.0  # 1.0: no classifier-free guidance
    # The harness's own training, pinned whatever configs/tiny.py (its starting point) uses:
    learning_rate: float = 1e-4  # the base config's; stable for every preset here
    rows_per_minibatch: int = 30
    # One optimizer update per iteration for every preset: the gradient is accumulated over
    # all of the iteration's minibatches (False: one update per minibatch, the trainer's
    # default, which gives presets with more rows more updates per iteration).
    one_update_per_iteration: bool = True
    inner_epochs: int = 1  # passes over each iteration's rows
    clip_range: float = 1e-4  # PPO clip
    eval_count: int = 50  # fixed evaluation prompts (each digit five times, own noise)
    reward: str = "digit_alignment"


def make_config(preset: str, settings: Settings, seed: int = 0):
    """The tiny demo config (configs/tiny.py) with the preset's tree and the shared settings."""
    from configs import tiny

    c = tiny.get_config()
    c.name = f"bench_{preset}"
    c.seed = seed
    c.model.name = "random_tiny" if settings.model == "standin" else settings.model
    c.prompts.batch_size = settings.prompts
    c.prompts.eval_count = settings.eval_count
    c.sampling.num_steps = settings.num_steps
    c.sampling.guidance_scale = settings.guidance_scale
    c.tree.window_slide_every = 0  # a fixed window: one compiled rollout per preset
    c.rewards = settings.reward
    c.train.learning_rate = settings.learning_rate
    c.train.rows_per_minibatch = settings.rows_per_minibatch
    c.train.inner_epochs = settings.inner_epochs
    c.train.clip_range = settings.clip_range
    c.eval.extra_rewards = ("digit_accuracy",)
    c.checkpoint.every = 0
    c.log.progress = False
    c.log.tensorboard = False
    for path, value in {**PRESETS, **FLOW_PRESETS}[preset].items():
        section, field = path.split(".")
        c[section][field] = value
    if settings.one_update_per_iteration:
        c.train.grad_accumulation = minibatches_per_iteration(c)
    return c


def minibatches_per_iteration(config) -> int:
    """Minibatches the first iteration of `config` cuts its rows into in one inner epoch
    (every setting's first iteration is on-policy: a replay buffer is still empty)."""
    return max(1, time_plan.minibatches_in_epoch(config, 0))


def load_model(settings: Settings) -> TextToImageModel:
    if settings.model == "standin":
        return standin_model()
    from tree_grpo_jax.models.tiny.model import build_tiny, load_tiny

    if settings.model == "random_tiny":
        return build_tiny("ddim", seed=0)
    return load_tiny("flow" if settings.model == "tiny_flow" else "ddim")
