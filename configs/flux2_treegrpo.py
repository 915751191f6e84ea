"""FLUX.2-dev with TreeGRPO: BranchGRPO's released FLUX SDE, credit and optimizer settings
(configs/flux_branchgrpo.py `release_settings`: its DanceGRPO SDE at eta 0.3, mean reward
fusion, depth-wise advantages clipped at 5, PPO clip 1e-3, learning rate 1e-5, HPS-v2.1) on
Flow-Factory's FLUX.2-dev model and sampling settings (X-GenGroup/Flow-Factory
`examples/grpo/lora/flux2/t2i.yaml`: 512 px, 8 steps, the embedded guidance 4 (also
Flux2Pipeline's default guidance_scale), 28 evaluation steps; its LoRA rank 64 / alpha 128,
learning rate 3e-4) with TreeGRPO's tree: a window of 4 BRANCH(2) SDE steps (16 leaves per
prompt) sliding one step every iteration, ODE elsewhere, leaf advantages averaged up the
tree.

FLUX.2-dev's guidance is distilled into the transformer (`model.flux2.guidance`, passed at
every step); the package's classifier-free guidance stays off. The schedule is the
pipeline's (the empirical mu of FLUX.2's sampling code for 8 steps at 512 px); the text is
the pipeline's 512 tokens of three Mistral Small 3.1 states after its system turn (the
family's defaults). The 32B transformer needs its parameters sharded: plan with
`--devices=8 --config.mesh.fsdp=8`. No released code trains FLUX.2 with a tree method; these
are a starting point, not a paper's recipe.

python -m tree_grpo_jax.main --config=configs/flux2_treegrpo.py \
    --config.model.path=/path/to/FLUX.2-dev --config.reward_models.hpsv2=/path/to/hpsv2.1
"""

from configs import flux_branchgrpo
from tree_grpo_jax.config import base_config


def release_model_settings(c):
    """Flow-Factory's FLUX.2-dev model and sampling settings on `c`: 512 px, 8 steps at the
    embedded guidance 4, 28 evaluation steps."""
    c.model.name = "flux2"
    c.model.path = "black-forest-labs/FLUX.2-dev"
    c.model.compute_dtype = "bfloat16"
    c.model.remat = True
    c.model.attention = "auto"  # cuDNN on GPUs, Pallas on TPUs, blockwise on long CPU rows
    c.model.flux2.resolution = 512
    c.model.flux2.guidance = 4.0
    c.sampling.num_steps = 8
    c.sampling.guidance_scale = 1.0  # the guidance is the embedded one, not CFG
    c.eval.num_steps = 28
    return c


def get_config():
    c = flux_branchgrpo.release_settings(base_config())
    c = release_model_settings(c)
    c.name = "flux2_treegrpo"
    c.tree.method = "treegrpo"
    c.tree.window = 4
    c.tree.k = 2
    c.tree.window_start = 0
    c.tree.window_slide_every = 1
    c.tree.split_noise_scale = 1.0
    return c
