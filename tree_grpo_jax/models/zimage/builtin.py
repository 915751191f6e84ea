"""Z-Image-Turbo's JSON configs as data: `model.path=builtin:z-image-turbo` plans a run on the
public release (Tongyi-MAI/Z-Image-Turbo) without any of its files.

The values are the release's `transformer/config.json` (a single-stream DiT: 2 noise and 2
context refiner blocks, then 30 blocks of width 3840 with 30 heads of 128, rotary axes
32/48/48 with theta 256; prompt states 2560 wide), `vae/config.json` (FLUX.1's 16-channel
`AutoencoderKL`: scaling 0.3611, shift 0.1159), `scheduler/scheduler_config.json`
(FlowMatchEulerDiscreteScheduler with the static shift 3) and the text encoder's
`config.json` (Qwen3-4B).
"""

from __future__ import annotations

from tree_grpo_jax.models import builtin_configs
from tree_grpo_jax.models.abstract import BuiltinRelease

_TRANSFORMER = {
    "_class_name": "ZImageTransformer2DModel",
    "all_f_patch_size": [1],
    "all_patch_size": [2],
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
    "cap_feat_dim": 2560,
    "dim": 3840,
    "in_channels": 16,
    "n_heads": 30,
    "n_kv_heads": 30,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
}
_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": False,
}

Z_IMAGE_TURBO = BuiltinRelease(
    hub_id="Tongyi-MAI/Z-Image-Turbo",
    configs={
        "transformer/config.json": _TRANSFORMER,
        "vae/config.json": builtin_configs.vae_16_channels(0.3611, 0.1159),
        "scheduler/scheduler_config.json": _SCHEDULER,
        "text_encoder/config.json": builtin_configs.QWEN3_4B,
    },
)

RELEASES = {"z-image-turbo": Z_IMAGE_TURBO}
