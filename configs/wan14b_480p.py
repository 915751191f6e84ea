"""Wan2.1-T2V-14B with BranchGRPO at the model's own 480x832, 81-frame setting (21 latent
frames, 32,760 tokens a video), fully fine-tuned on 8 GPUs of 80 GB: configs/wan_branchgrpo.py's
tree, credit and optimizer settings (BranchGRPO's released FLUX script) with

- `mesh.sequence=8`: each video's tokens split over the 8 GPUs of a host (attention by
  all-to-alls over its 40 heads), the weights and optimizer state over the same 8
  (docs/devices-and-hosts.md); more hosts add `mesh.data`;
- one prompt (its 16 leaves) and one train row per 8 GPUs, one denoiser row at a time in
  the rollout (flow_shift 3.0 stays: WanPipeline's value below 720p).

By plan (CPU-compiled, not measured on a GPU): 52.96 GiB per device for the train step, the
largest program, within JAX's default 75% of 80 GB.

python -m tree_grpo_jax.plan --config=configs/wan14b_480p.py --devices=8 \
    --config.model.path=builtin:wan-14b
launch/gpu.sh configs/wan14b_480p.py --config.model.path=/path/to/Wan2.1-T2V-14B-Diffusers \
    --config.reward_models.hpsv2=/path/to/hpsv2.1
"""

from configs import wan_branchgrpo


def get_config():
    c = wan_branchgrpo.get_config()
    c.name = "wan14b_480p"
    c.model.path = "Wan-AI/Wan2.1-T2V-14B-Diffusers"
    c.model.wan.resolution = (480, 832)
    c.model.wan.num_frames = 81
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.sequence = 8
    c.prompts.batch_size = 1
    c.train.rows_per_minibatch = 1
    c.sampling.denoise_rows = 1
    return c
