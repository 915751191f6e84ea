"""Wan2.1-T2V-1.3B with flat GRPO as Flow-Factory's Wan2.1 text-to-video example trains it
(`examples/grpo/full/wan21/t2v.yaml`): 256x256 px, 5 frames, 10 steps with flow_shift 3,
guidance 5, 16 videos per prompt, the Flow-GRPO SDE at noise level 0.9, PPO clip 1e-4,
advantages clipped at 5, no KL, full fine-tuning with learning rate 1e-4 and weight decay
1e-4. Flow-Factory noises only one step per sample, drawn from steps 1 to 3; flat GRPO here
noises every step, as Flow-GRPO does (configs/sd35m_grpo.py). Its 14B example is the same
with `--config.model.path=Wan-AI/Wan2.1-T2V-14B-Diffusers`. Its reward is CLIP (weight 1)
and PickScore (weight 0.5) combined by its `gdpo` advantage aggregation; here the Wan
configs' HPS-v2.1, frame by frame (`--config.rewards=clip_score:1,pickscore:0.5` is a
weighted sum of the raw scores, whose scales then weigh too)."""

from configs import wan_branchgrpo


def get_config():
    c = wan_branchgrpo.get_config()
    c.name = "wan_grpo"
    c.model.wan.resolution = (256, 256)
    c.model.wan.num_frames = 5
    c.sampling.num_steps = 10
    c.sampling.flow_sde = "flow_grpo"
    c.sampling.noise_level = 0.9
    c.tree.method = "grpo"
    c.tree.group_size = 16
    c.train.learning_rate = 1e-4
    c.train.clip_range = 1e-4
    c.train.rows_per_minibatch = 16
    c.train.grad_accumulation = 1
    return c
