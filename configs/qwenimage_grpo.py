"""Qwen-Image with flat GRPO at Flow-GRPO's released Qwen-Image settings
(yifan123/flow_grpo `config/grpo.py`, `pickscore_qwenimage` / `pickscore_qwenimage_8gpu`,
with `scripts/train_qwenimage.py`), the figures checked against VeRL-Omni's Qwen-Image
Flow-GRPO example (verl-project/verl-omni
`examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora.sh` and its trainer's defaults
in `verl_omni/trainer/config/_generated_diffusion_trainer.yaml`):

- both: 512x512 px, 10 sampling steps on the folder's dynamic-shift schedule, 50 steps for
  evaluation, guidance 4, the Flow-GRPO SDE (`sde`) at noise level 1.2, 16 images per
  prompt, 32 prompts per step (512 images), two optimizer updates per step, no KL (beta 0),
  advantages clipped at 5, LoRA rank 64 / alpha 128 on the attention projections of both
  streams and both streams' MLPs, learning rate 3e-4, weight decay 1e-4, gradient norm 1,
  bf16 with gradient checkpointing;
- Flow-GRPO: PPO clip 1e-4 (its default), PickScore reward, checkpoints and evaluation every
  30 steps;
- VeRL-Omni: prompts of at most 256 text tokens (`max_sequence_length=256`; Flow-GRPO leaves
  the pipeline's 512), 300 training steps. It clips at 1e-5 and rewards OCR with a VLM judge.
  Its published throughput for this script: 4 x H800, 420 s per step; the full-weight
  variant (`run_qwen_image_ocr.sh`: guidance 1, learning rate 3e-5) 250 s per step on
  4 x H200.

What differs here: both releases noise only a window of 2 consecutive steps whose start is
drawn each step from steps 0-3 (`sde_window_size` 2, `sde_window_range` (0, 5)) and train only
those 2 steps; flat GRPO noises and trains all 10 (`--config.tree.method=mixgrpo
--config.tree.window=2 --config.tree.window_slide_every=1` keeps a 2-step window, sliding over
all steps instead of drawn). Their guidance is Qwen-Image's true CFG against the negative
prompt " " with the guided velocity rescaled to the conditional one's norm; here plain
classifier-free guidance against the empty prompt. Their advantages take the per-prompt mean
and the whole batch's std (`global_std`); here each prompt's own std. Prompts: the built-in
set (Flow-GRPO trains on its `dataset/pickscore` prompts; pass a prompt file).

python -m tree_grpo_jax.main --config=configs/qwenimage_grpo.py \
    --config.model.path=/path/to/Qwen-Image --config.reward_models.pickscore=/path/to/pickscore
"""

from tree_grpo_jax.config import base_config

# The LoRA targets both releases name (PEFT's `attn.to_q`, ..., `img_mlp.net.0.proj`), as this
# package's module-path endings.
LORA_TARGETS = (
    "to_q", "to_k", "to_v", "to_out_0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "img_mlp/net_0/proj", "img_mlp/net_2", "txt_mlp/net_0/proj", "txt_mlp/net_2",
)  # fmt: skip


def release_model_settings(c):
    """The released Qwen-Image runs' model and sampling settings on `c` (the tree configs
    take them too): 512 px, 256 text tokens, 10 steps, guidance 4, 50 evaluation steps."""
    c.model.name = "qwenimage"
    c.model.path = "Qwen/Qwen-Image"
    c.model.compute_dtype = "bfloat16"
    c.model.remat = True
    c.model.attention = "auto"  # cuDNN on GPUs, Pallas on TPUs, blockwise on long CPU rows
    c.model.qwenimage.resolution = 512
    c.model.qwenimage.text_max_length = 256
    c.sampling.num_steps = 10
    c.sampling.guidance_scale = 4.0  # plain CFG (the releases rescale their true CFG)
    c.eval.num_steps = 50
    return c


def release_lora(c):
    """LoRA as both releases train Qwen-Image: rank 64, alpha 128, learning rate 3e-4."""
    c.lora.rank = 64
    c.lora.alpha = 128.0
    c.lora.targets = LORA_TARGETS
    c.train.learning_rate = 3e-4
    return c


def get_config():
    c = release_lora(release_model_settings(base_config()))
    c.name = "qwenimage_grpo"
    c.prompts.source = "animals"
    c.prompts.batch_size = 32
    c.prompts.eval_count = 8
    c.sampling.flow_sde = "flow_grpo"
    c.sampling.noise_level = 1.2
    # rows of the whole batch at a time: their 4 images per GPU with their CFG pairs on one
    # device (on N devices, a multiple of N: N x 8 keeps 4 images a device)
    c.sampling.denoise_rows = 8
    c.tree.method = "grpo"
    c.tree.group_size = 16
    c.advantage.clip = 5.0
    c.rewards = "pickscore"
    c.train.iterations = 300
    c.train.weight_decay = 1e-4
    c.train.max_grad_norm = 1.0
    c.train.clip_range = 1e-4
    c.train.kl_beta = 0.0
    c.train.rows_per_minibatch = 16
    c.train.updates_per_iteration = 2
    c.eval.every = 30
    c.checkpoint.every = 30
    return c
