"""Z-Image-Turbo with flat GRPO at Flow-Factory's released Z-Image-Turbo GRPO settings
(X-GenGroup/Flow-Factory `examples/grpo/lora/z_image_turbo/default.yaml`; the full-weight
`examples/grpo/full/z_image_turbo/default.yaml` differs in learning rate 1e-5, no LoRA, and
1024 px evaluation): 512x512 px, 6 sampling steps and 10 for evaluation on the folder's
static shift 3, no classifier-free guidance (its guidance_scale 0; here 1.0, the package's
"off"), the Flow-GRPO SDE (`Flow-SDE`) at noise level 0.7, 16 images per prompt, 48 prompts
per step, two optimizer updates per step, PPO clip 1e-4, advantages clipped at 5, no KL, LoRA
rank 64 / alpha 128 on its default targets (each attention's to_q, to_k, to_v, to_out and
each feed-forward's w1, w2, w3) with fp32 master weights, learning rate 3e-4, weight decay
1e-4, gradient norm 1, bf16, PickScore reward, evaluation and checkpoints every 40 steps.

What differs here: Flow-Factory noises and trains one step per sample, drawn from steps 1-3
(`num_sde_steps` 1, `sde_steps` [1, 2, 3]); flat GRPO noises and trains all 6, as Flow-GRPO
does (configs/sd35m_grpo.py). It normalises each prompt's group by its own std, as here, and
keeps an EMA of the weights (decay 0.9 every 4 steps), which this config does not. Its
prompts are its `dataset/pickscore` set (here the built-in set; pass a prompt file). Its text
length is the pipeline's 512 tokens, the family's default here.

python -m tree_grpo_jax.main --config=configs/zimage_grpo.py \
    --config.model.path=/path/to/Z-Image-Turbo --config.reward_models.pickscore=/path/to/pickscore
"""

from tree_grpo_jax.config import base_config

# Flow-Factory's default Z-Image targets (PEFT's `attention.to_q`, ..., `feed_forward.w1`), as
# this package's module-path endings.
LORA_TARGETS = (
    "attention/to_q", "attention/to_k", "attention/to_v", "attention/to_out_0",
    "feed_forward/w1", "feed_forward/w2", "feed_forward/w3",
)  # fmt: skip


def release_model_settings(c):
    """Flow-Factory's Z-Image-Turbo model and sampling settings on `c` (the tree configs take
    them too): 512 px, 6 steps, 10 evaluation steps, no classifier-free guidance."""
    c.model.name = "zimage"
    c.model.path = "Tongyi-MAI/Z-Image-Turbo"
    c.model.compute_dtype = "bfloat16"
    c.model.remat = True
    c.model.attention = "auto"  # cuDNN on GPUs, Pallas on TPUs, blockwise on long CPU rows
    c.model.zimage.resolution = 512
    c.sampling.num_steps = 6
    c.sampling.guidance_scale = 1.0  # distilled: no classifier-free guidance
    c.eval.num_steps = 10
    return c


def get_config():
    c = release_model_settings(base_config())
    c.name = "zimage_grpo"
    c.lora.rank = 64
    c.lora.alpha = 128.0
    c.lora.targets = LORA_TARGETS
    c.prompts.source = "animals"
    c.prompts.batch_size = 48
    c.prompts.eval_count = 8
    c.sampling.flow_sde = "flow_grpo"
    c.sampling.noise_level = 0.7
    c.sampling.denoise_rows = 16  # bounds the rollout's activations (the same numbers)
    c.tree.method = "grpo"
    c.tree.group_size = 16
    c.advantage.clip = 5.0
    c.rewards = "pickscore"
    c.train.iterations = 300
    c.train.learning_rate = 3e-4
    c.train.weight_decay = 1e-4
    c.train.max_grad_norm = 1.0
    c.train.clip_range = 1e-4
    c.train.kl_beta = 0.0
    c.train.rows_per_minibatch = 16
    c.train.updates_per_iteration = 2
    c.eval.every = 40
    c.checkpoint.every = 40
    return c
