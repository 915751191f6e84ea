"""Objectives are strategies the method table holds: a toy objective defined here, outside the
package, with one table entry, is checked by config.validate through its own hooks and is
what the trainer trains through (its rows, its loss, its old policy and its after-update)."""

import jax
import numpy as np
import pytest

from tree_grpo_jax import config as cfg
from tree_grpo_jax import methods
from tree_grpo_jax.config import base_config
from tree_grpo_jax.core.loss import ppo_loss
from tree_grpo_jax.methods.ppo import PPOObjective
from tree_grpo_jax.run import loop as train
from tree_grpo_jax.run.train_step import OldPolicyState

CALLS = []


def _frozen_loss(params, batch, settings, inputs):
    """PPO's loss times zero: no gradient, so weights without weight decay cannot move. The
    old policy reaches it because the objective keeps one."""
    assert inputs.old_params is not None
    loss, metrics = ppo_loss(params, batch, settings, inputs)
    return 0.0 * loss, metrics


class FrozenObjective(PPOObjective):
    """PPO's rows with a loss that trains nothing, and an old policy of its own."""

    name = "frozen"
    keeps_old_policy = True

    def check_section(self, config):
        if config.train.weight_decay != 0:
            return "the frozen objective needs train.weight_decay=0."
        return None

    def check_run(self, config, spec):
        return "the frozen tree has no root." if spec.leaves > 99 else None

    def rows(self, method, config, source, key=None):
        CALLS.append(("rows", source.iteration, source.rewards.shape))
        return super().rows(method, config, source, key)

    def loss(self, config, denoise_fn):
        _, settings = super().loss(config, denoise_fn)
        return _frozen_loss, settings

    def after_update(self, config, old, params, iteration):
        CALLS.append(("after_update", iteration))
        return params, {"toy_after_update": iteration}


@pytest.fixture
def frozen_method():
    entry = methods.register(
        methods.Method(
            "frozen_grpo",
            spec=methods.get("grpo").spec,
            advantages=methods.get("grpo").advantages,
            objective=FrozenObjective(),
        )
    )
    CALLS.clear()
    yield entry
    methods.unregister(entry.name)


def small_config():
    c = base_config()
    c.model.name = "random_tiny"
    c.prompts.batch_size = 2
    c.prompts.eval_count = 2
    c.sampling.num_steps = 4
    c.tree.method = "frozen_grpo"
    c.tree.group_size = 4
    c.train.iterations = 1
    c.train.rows_per_minibatch = 8
    c.train.weight_decay = 0.0
    c.rewards = "jpeg_compressibility"
    c.eval.every = 0
    c.log.progress = False
    c.log.tensorboard = False
    return c


def test_each_objective_checks_its_own_fields(frozen_method):
    c = small_config()
    cfg.validate(c)
    c.train.weight_decay = 1e-4
    with pytest.raises(cfg.ConfigError, match="^the frozen objective needs train.weight_decay=0.$"):
        cfg.validate(c)
    # its section is checked whichever method runs
    c.tree.method = "grpo"
    with pytest.raises(cfg.ConfigError, match="frozen objective"):
        cfg.validate(c)
    c.train.weight_decay = 0.0
    c.tree.method, c.tree.group_size = "frozen_grpo", 100
    with pytest.raises(cfg.ConfigError, match="^the frozen tree has no root.$"):
        cfg.validate(c)
    assert frozen_method.objective in methods.objectives()


def test_the_trainer_trains_through_the_method_s_objective(frozen_method, tmp_path):
    trainer, state = train.setup(small_config(), str(tmp_path))
    assert trainer.method is frozen_method
    assert isinstance(state, OldPolicyState)  # keeps_old_policy
    before = jax.device_get(state.params)
    state, metrics = trainer.iteration(state, 0)
    assert CALLS == [("rows", 0, (2, 4)), ("after_update", 0)]
    assert metrics["toy_after_update"] == 0
    assert metrics["train_rows"] > 0
    # a zero loss under Adam without weight decay leaves every weight as it was; PPO's own
    # loss (tests/test_train.py) moves them
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, jax.device_get(state.params))
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, jax.device_get(state.old_params))


def _tiny_flow_run(tmp_path, guard: bool):
    from configs import tiny_flow

    c = tiny_flow.get_config()
    c.rewards = "jpeg_compressibility"
    c.eval.extra_rewards = ()
    c.prompts.batch_size = 2
    c.prompts.eval_count = 2
    c.train.iterations = 1
    c.eval.every = 0
    c.log.progress = False
    c.log.tensorboard = False
    c.grpo_guard.enabled = guard
    trainer, state = train.setup(c, str(tmp_path / f"guard_{guard}"))
    return trainer.iteration(state, 0)[1]


@pytest.mark.slow
def test_grpo_guard_off_leaves_today_s_numbers_and_on_regulates_the_ratio(tmp_path):
    """TreeGRPO on the flow twin, one iteration: with the guard off, the figures the code
    gave before the guard existed (recorded from that code, this machine's CPU); with it on,
    the same rollout and rewards, a ratio of exactly 1 on its one minibatch (the weights
    that rolled out are the weights scored) and a gradient of its own."""
    off = _tiny_flow_run(tmp_path, guard=False)
    # the loss is -mean(A) at ratio 1: zero up to rounding, which the program's fusion sets
    assert abs(off["loss"] - 1.390775050680304e-08) < 1e-7
    recorded = {
        "reward_mean": -0.39509375020861626,
        "grad_norm": 0.06710987538099289,
        "ratio_min": 0.9999998807907104,
        "ratio_max": 1.0000001192092896,
        "trained_edges": 60,
        "train_rows": 30,
    }
    for name, value in recorded.items():
        np.testing.assert_allclose(off[name], value, rtol=1e-5, err_msg=name)
    on = _tiny_flow_run(tmp_path, guard=True)
    assert on["reward_mean"] == off["reward_mean"]
    assert on["ratio_min"] == pytest.approx(1.0, abs=1e-6)
    assert on["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    # its gradient is the plain one scaled by each step's std over |dt|
    assert abs(on["grad_norm"] - off["grad_norm"]) > 0.05 * off["grad_norm"]
