"""TreeGRPO on the tiny rectified-flow twin: the Flow-GRPO SDE (a = 0.7) in the branch window."""

from configs import tiny


def get_config():
    c = tiny.get_config()
    c.name = "tiny_flow"
    c.model.name = "tiny_flow"
    c.sampling.noise_level = 0.7
    c.sampling.shift = 1.0
    # The demo stops at 10 iterations; the flow twin and the methods built on it keep 30, the
    # length their studies and figures were made with.
    c.train.iterations = 30
    return c
