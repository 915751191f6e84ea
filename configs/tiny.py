"""The embedded default: TreeGRPO on the tiny digits model, a few minutes on a laptop CPU.

python -m tree_grpo_jax.main --config=configs/tiny.py
"""

from configs import base


def get_config():
    c = base.get_config()
    c.name = "tiny"
    c.model.name = "tiny"
    c.prompts.source = "digits"
    c.prompts.batch_size = 4
    c.sampling.num_steps = 10
    c.sampling.guidance_scale = 1.0  # guidance 3 already saturates the digit reward
    c.tree.method = "treegrpo"
    c.tree.window = 4
    c.tree.k = 2
    c.tree.window_slide_every = 0
    # The paper's credit: an edge takes the mean of the leaf advantages below it. Per-depth
    # normalization, more trees at 16 leaves and k4 w2 were no better on both tiny rewards
    # (BENCHMARKS.md, section 9).
    c.advantage.edge_normalization = "none"
    c.rewards = "digit_alignment"
    c.train.iterations = 30
    c.train.learning_rate = 1e-4
    # Two updates per iteration, each over all of its 60 rows (one minibatch), with a clip
    # range that leaves the second one acting (at 1e-4 it clipped 95% of its edges). For
    # +40% time per iteration, treegrpo needed half the images on jpeg_compressibility and
    # fewer late on digit_alignment (359 against 430 to 80% of its gain; 214 against 134 to
    # half of it): BENCHMARKS.md, section 9.
    c.train.rows_per_minibatch = 60
    c.train.inner_epochs = 2
    c.train.clip_range = 1e-2
    c.prompts.eval_count = 100  # ten fixed noises per digit
    c.eval.every = 5
    c.eval.extra_rewards = ("digit_accuracy",)
    c.checkpoint.every = 10
    return c
