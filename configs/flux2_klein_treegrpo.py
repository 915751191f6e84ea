"""FLUX.2-klein (4B or 9B, the step-distilled releases) with TreeGRPO: BranchGRPO's released
FLUX SDE, credit and optimizer settings (configs/flux_branchgrpo.py `release_settings`: its
DanceGRPO SDE at eta 0.3, mean reward fusion, depth-wise advantages clipped at 5, PPO clip
1e-3, learning rate 1e-5, HPS-v2.1) on Flow-Factory's FLUX.2-klein model and sampling
settings (X-GenGroup/Flow-Factory `examples/grpo/lora/flux2_klein/default.yaml`: 384 px, 4
steps, as the release is distilled to, guidance_scale 1 (no guidance), 10 evaluation steps;
its LoRA rank 64 / alpha 128, learning rate 3e-4) with TreeGRPO's tree: a window of 3
BRANCH(2) SDE steps (8 leaves per prompt) sliding one step every iteration, ODE elsewhere,
leaf advantages averaged up the tree.

The schedule is the pipeline's (Flux2KleinPipeline: the empirical mu of FLUX.2's sampling
code for 4 steps at 384 px); the text is the pipeline's 512 tokens of three Qwen3 states
(the family's defaults). Flow-Factory noises one step per sample from steps 1-2 at noise
level 0.5 (Flow-GRPO's SDE); the tree here branches at 3 of the 4 steps. No released code
trains FLUX.2 with a tree method; these are a starting point, not a paper's recipe.

python -m tree_grpo_jax.main --config=configs/flux2_klein_treegrpo.py \
    --config.model.path=/path/to/FLUX.2-klein-4B --config.reward_models.hpsv2=/path/to/hpsv2.1
"""

from configs import flux_branchgrpo
from tree_grpo_jax.config import base_config


def release_model_settings(c):
    """Flow-Factory's FLUX.2-klein model and sampling settings on `c`: 384 px, 4 steps, 10
    evaluation steps, no guidance."""
    c.model.name = "flux2"
    c.model.path = "black-forest-labs/FLUX.2-klein-4B"
    c.model.compute_dtype = "bfloat16"
    c.model.remat = True
    c.model.attention = "auto"  # cuDNN on GPUs, Pallas on TPUs, blockwise on long CPU rows
    c.model.flux2.resolution = 384
    c.sampling.num_steps = 4  # the release is distilled to 4 steps
    c.sampling.guidance_scale = 1.0  # distilled: no classifier-free guidance
    c.eval.num_steps = 10
    return c


def get_config():
    c = flux_branchgrpo.release_settings(base_config())
    c = release_model_settings(c)
    c.name = "flux2_klein_treegrpo"
    c.tree.method = "treegrpo"
    c.tree.window = 3
    c.tree.k = 2
    c.tree.window_start = 0
    c.tree.window_slide_every = 1
    c.tree.split_noise_scale = 1.0
    return c
