"""Stable Diffusion 3.5 Medium with CRD as Flow-Factory's release runs the paper's Table 3 OCR
setting (examples/crd/lora/sd3_5/default.yaml over CRDTrainingArguments): 10 deterministic
flow steps without guidance, 24 samples per prompt, each group trained at 20 times drawn
from the sampler's own sigmas (stratified over the top 99% of the steps), beta 1, the
squared-error match against the old copy with adaptive weights, uniform centring, the old
copy's decay 0.25 rising by 0.005 per optimizer step to 0.999, a KL of 0.1 to the initial
model guided at 4.5 and weighted by the reward, advantages clipped to 5 over the batch's
std, learning rate 3e-4, two optimizer updates per iteration, LoRA rank 32 (alpha 64).

python -m tree_grpo_jax.main --config=configs/sd35m_crd.py \
    --config.model.path=/path/to/sd3.5-medium
Left out: the OCR reward (PickScore here), the release's second snapshot that samples once
75 steps are done (here the trained weights always sample). Their batch is 48 groups per
iteration over 8 GPUs; here `prompts.batch_size` per host, and a train row is one group at
one time.
"""

from configs import sd35m


def get_config():
    c = sd35m.get_config()
    c.name = "sd35m_crd"
    c.tree.method = "crd"
    c.tree.window_slide_every = 0
    c.tree.group_size = 24
    c.sampling.guidance_scale = 1.0
    c.crd.train_timesteps = 20  # their num_train_timesteps
    c.lora.rank = 32
    c.lora.alpha = 64.0
    c.train.learning_rate = 3e-4
    c.train.kl_beta = 0.1  # their kl_beta, the KL's reference guided at crd.kl_cfg = 4.5
    c.train.updates_per_iteration = 2  # their gradient_step_per_epoch
    c.train.grad_accumulation = 1
    c.train.rows_per_minibatch = 1  # one group of 24 per train step
    c.rewards = "pickscore"
    c.eval.num_steps = 14
    return c
