"""run.reuse: settings compared by value (functions by identity), the last few kept; and a
run set up twice in one process gets its programs back only for equal settings."""

import functools

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from small_configs import small_config

from tree_grpo_jax import sharding
from tree_grpo_jax.run import build, reuse
from tree_grpo_jax.run.train_step import StepLayout, TrainState


def _denoise(params, x, t, cond):
    return x


def _other_denoise(params, x, t, cond):
    return x


def _shardings(spec):
    mesh = sharding.make_mesh(1, 1)
    leaf = NamedSharding(mesh, spec)
    return TrainState(params={"w": leaf, "b": leaf}, opt_state=(leaf,))


def _layout(alpha, spec):
    base = _shardings(spec).params
    merge = functools.partial(_denoise, t=alpha)
    return StepLayout(_denoise, merge=merge, frozen_shardings=base, ref_shardings=base)


@pytest.mark.parametrize(
    "first, second, equal",
    [
        (dict(clip=0.2, fn=_denoise), dict(fn=_denoise, clip=0.2), True),
        (dict(clip=0.2, fn=_denoise), dict(clip=0.3, fn=_denoise), False),
        (dict(clip=0.2, fn=_denoise), dict(clip=0.2, fn=_other_denoise), False),
        (dict(flag=True), dict(flag=1), False),  # a bool is not its int
        ((1, [2.0, "a"]), (1, [2.0, "a"]), True),
        ((1, [2.0, "a"]), (1, (2.0, "a")), False),
        (functools.partial(_denoise, t=1), functools.partial(_denoise, t=1), True),
        (functools.partial(_denoise, t=1), functools.partial(_denoise, t=2), False),
        (_shardings(P()), _shardings(P()), True),
        (_shardings(P()), _shardings(P("data")), False),
        (None, None, True),
        # a LoRA step's layout: a fresh merge partial and shardings per build, equal by value
        (_layout(alpha=8.0, spec=P()), _layout(alpha=8.0, spec=P()), True),
        (_layout(alpha=8.0, spec=P()), _layout(alpha=4.0, spec=P()), False),
        (_layout(alpha=8.0, spec=P()), _layout(alpha=8.0, spec=P("data")), False),
    ],
)
def test_settings_keys_are_equal_exactly_for_equal_settings(first, second, equal):
    assert (reuse.settings_key(first) == reuse.settings_key(second)) is equal


def test_a_setting_it_cannot_compare_is_refused():
    with pytest.raises(TypeError):
        reuse.settings_key({"weights": jax.numpy.ones(3)})


def test_kept_builds_once_per_settings_and_forgets_the_oldest():
    kept = reuse.Kept(2)
    built = []

    def build_for(name):
        def make():
            built.append(name)
            return object()

        return make

    a = kept.get(("a", 1), build_for("a"))
    assert kept.get(("a", 1), build_for("a again")) is a
    b = kept.get(("b", 1), build_for("b"))
    kept.get(("a", 1), build_for("a once more"))  # a is now the most recent
    kept.get(("c", 1), build_for("c"))  # b, the oldest, goes
    assert kept.get(("a", 1), build_for("a late")) is a
    assert kept.get(("b", 1), build_for("b again")) is not b
    # settings that cannot be compared always build, and nothing is kept for them
    kept.get({"array": jax.numpy.ones(2)}, build_for("array"))
    kept.get({"array": jax.numpy.ones(2)}, build_for("array again"))
    assert built == ["a", "b", "c", "b again", "array", "array again"]


def test_a_second_setup_reuses_the_programs_of_equal_settings_only(tmp_path):
    c = small_config("treegrpo")
    first, _ = build.setup(c, str(tmp_path / "one"))
    again, _ = build.setup(c.copy_and_resolve_references(), str(tmp_path / "two"))
    for name in ("train_step", "init_state", "sampling_denoise"):
        assert getattr(again, name) is getattr(first, name), name
    assert again.accumulating is first.accumulating
    other = c.copy_and_resolve_references()
    other.train.clip_range = 0.3  # a constant of the loss: another program
    changed, _ = build.setup(other, str(tmp_path / "three"))
    assert changed.train_step is not first.train_step
    assert changed.sampling_denoise is first.sampling_denoise  # the sampler did not change
    other.train.adam_b2 = 0.99  # the optimizer's
    assert build.setup(other, str(tmp_path / "four"))[0].train_step is not changed.train_step


def test_a_second_lora_setup_reuses_its_steps_and_another_alpha_does_not(tmp_path):
    # each setup builds its own merge partial and base shardings: equal by value, not identity
    c = small_config("treegrpo")
    c.lora.rank, c.lora.alpha, c.train.kl_beta = 2, 4.0, 0.01
    first, _ = build.setup(c, str(tmp_path / "one"))
    again, _ = build.setup(c.copy_and_resolve_references(), str(tmp_path / "two"))
    assert again.train_step is first.train_step
    assert again.accumulating is first.accumulating
    other = c.copy_and_resolve_references()
    other.lora.alpha = 8.0  # the merge's scale: another program
    assert build.setup(other, str(tmp_path / "three"))[0].train_step is not first.train_step
