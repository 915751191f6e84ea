"""Qwen-Image with BranchGRPO: the tree, SDE, credit and optimizer settings of BranchGRPO's
released FLUX script (configs/flux_branchgrpo.py, from its
`scripts/finetune/finetune_flux_branchgrpo_8gpus.sh`: BRANCH(2) at steps 0, 3, 6 and 9 with
split noise 4.0, one root per prompt, 16 leaves; its FLUX SDE at eta 0.3; mean reward fusion,
depth-wise advantages clipped at 5; PPO clip 1e-3; full fine-tuning at learning rate 1e-5;
HPS-v2.1) on the model and sampling settings of the released Qwen-Image GRPO runs
(configs/qwenimage_grpo.py, from yifan123/flow_grpo `config/grpo.py` `pickscore_qwenimage` and
verl-project/verl-omni `run_qwen_image_ocr_lora.sh`): 512 px, 256 text tokens, 10 steps on
the folder's dynamic-shift schedule, guidance 4, 50 evaluation steps.

BranchGRPO releases no Qwen-Image run: its split steps were placed on FLUX's 20 steps and here
fall on 10 (step 9 is the last). Both Qwen-Image releases train LoRA (rank 64, alpha 128,
learning rate 3e-4); `configs/qwenimage_grpo.py`'s `release_lora` gives it, which a 20B
transformer needs on one device (full fine-tuning keeps fp32 weights and Adam's two moments:
`--config.mesh.fsdp` shards them).

python -m tree_grpo_jax.main --config=configs/qwenimage_branchgrpo.py \
    --config.model.path=/path/to/Qwen-Image --config.reward_models.hpsv2=/path/to/hpsv2.1
"""

from configs import flux_branchgrpo, qwenimage_grpo
from tree_grpo_jax.config import base_config


def get_config():
    c = flux_branchgrpo.release_settings(base_config())
    c = qwenimage_grpo.release_model_settings(c)
    c.name = "qwenimage_branchgrpo"
    return c
