"""FLUX.1-dev with BranchGRPO as its released FLUX script runs it
(scripts/finetune/finetune_flux_branchgrpo_8gpus.sh): 720x720 px, 20 flow-matching steps
with a static shift of 3, the released FLUX SDE (`flow_sde="dancegrpo"`, eta 0.3, with the
score correction), BRANCH(2) at steps 0, 3, 6 and 9 with split noise 4.0 (16 leaves per
prompt, all from one initial noise), SDE elsewhere, mean reward fusion and depth-wise
advantages clipped at 5, no classifier-free guidance (the distilled guidance 3.5 is
embedded), PPO clip 1e-3, learning rate 1e-5, full fine-tuning with fp32 master weights,
bf16 compute and gradient checkpointing, HPS-v2.1 reward.

python -m tree_grpo_jax.main --config=configs/flux_branchgrpo.py \
    --config.model.path=/path/to/FLUX.1-dev --config.reward_models.hpsv2=/path/to/hpsv2.1

The script's `--timestep_fraction 0.6` and `--ignore_last` are parsed but not read by its
training loop, which trains every edge; so does this config. The released code scores split
children under the unscaled std: `--config.tree.split_log_prob=unscaled` does the same
(ours scores a split child under the Gaussian it was drawn from; docs/methods.md, "The
released codes' conventions", says what the two choices change). It makes an optimizer step
every 12 trained samples (gradient_accumulation_steps 12): here every 3 minibatches of 4 rows.
"""

from tree_grpo_jax.config import base_config


def get_config():
    c = base_config()
    c.name = "flux_branchgrpo"
    c.model.name = "flux"
    c.model.path = "black-forest-labs/FLUX.1-dev"
    c.model.flux.guidance = 3.5  # distilled guidance, embedded by the transformer
    c.model.flux.resolution = 720
    c.model.flux.shift = 3.0  # static, as the released codes shift linspace(1, 0, 21)
    c.sampling.guidance_scale = 1.0  # --cfg 0.0: no classifier-free guidance
    return release_settings(c)


def release_settings(c):
    """The released FLUX script's precision, sampler, tree, credit, reward and optimizer
    settings on `c`, whatever model it names (configs/wan_branchgrpo.py takes them too)."""
    c.model.compute_dtype = "bfloat16"
    c.model.remat = True
    c.model.attention = "auto"  # cuDNN on GPUs, Pallas on TPUs, blockwise on long CPU rows
    c.prompts.source = "animals"
    c.prompts.batch_size = 2
    c.prompts.eval_count = 8
    c.sampling.num_steps = 20
    c.sampling.flow_sde = "dancegrpo"
    c.sampling.flow_score_correction = True
    c.sampling.noise_level = 0.3  # their eta
    c.tree.method = "branchgrpo"
    c.tree.split_steps = (0, 3, 6, 9)
    c.tree.k = 2
    c.tree.num_trees = 1  # one root per prompt: every leaf starts from the same noise
    c.tree.split_noise_scale = 4.0
    c.tree.window_slide_every = 0
    c.advantage.fusion = "mean"
    c.advantage.branch_normalization = "depthwise"
    c.advantage.clip = 5.0
    c.rewards = "hpsv2"
    c.train.iterations = 300
    c.train.learning_rate = 1e-5
    c.train.weight_decay = 1e-4
    c.train.max_grad_norm = 1.0
    c.train.clip_range = 1e-3
    c.train.rows_per_minibatch = 4
    c.train.grad_accumulation = 3
    c.eval.every = 25
    c.checkpoint.every = 50
    return c
