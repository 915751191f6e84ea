"""Which program an XLA out-of-memory error came from, as its traceback tells, and the
settings the sentence names for it: the run's functions stood in for by functions of the
same names in namespaces of the same module names."""

import re

import jax
import pytest

from tree_grpo_jax.config import base_config, flatten
from tree_grpo_jax.run.out_of_memory import out_of_memory

ERROR = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.50GiB."


def _in(module: str, source: str):
    """The function that `source` defines, with `module` as its module's name."""
    namespace = {"__name__": module, "jax": jax, "ERROR": ERROR}
    exec(source, namespace)  # noqa: S102 - the test's own text
    return namespace


def _raised(call, config=None) -> str:
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        call()
    return str(out_of_memory(info.value, config or base_config()))


def _named(sentence: str) -> set:
    return set(re.findall(r"([a-z_]+\.[a-z_.]+)=", sentence.split("memory: ", 1)[1]))


def test_the_evaluation_after_an_iteration_names_the_eval_settings():
    evaluation = _in(
        "tree_grpo_jax.run.evaluation",
        "def sampler_program():\n    raise jax.errors.JaxRuntimeError(ERROR)\n",
    )
    loop = _in("tree_grpo_jax.run.loop", "def save_eval(iteration, run):\n    run()\n")
    text = _raised(lambda: loop["save_eval"](4, evaluation["sampler_program"]))
    assert text.startswith(
        "the device ran out of memory (1.50GiB) in the evaluation after iteration 4; "
    ), text
    named = _named(text)
    assert {"prompts.eval_count", "sampling.denoise_rows"} <= named, text
    assert named <= set(flatten(base_config(), leaves_only=True))
    assert not {"prompts.batch_size", "train.rows_per_minibatch"} & named, text


def test_a_compile_names_its_program():
    precompile = _in(
        "tree_grpo_jax.run.precompile",
        "def compile_one(name):\n    raise jax.errors.JaxRuntimeError(ERROR)\n",
    )
    text = _raised(lambda: precompile["compile_one"]("train step"))
    assert text.startswith("the device ran out of memory (1.50GiB) in the train step while "), text
    assert {"train.rows_per_minibatch", "model.remat"} <= _named(text), text


@pytest.mark.parametrize("devices, rows, lower", [(1, 0, 8), (1, 6, 3), (4, 0, 8), (8, 24, 8)])
def test_fewer_denoise_rows_stay_a_multiple_of_the_batch_shards(monkeypatch, devices, rows, lower):
    monkeypatch.setattr(jax, "device_count", lambda: devices)
    rollout = _in(
        "tree_grpo_jax.run.trainer",
        "def _rollout_program(self=None):\n    raise jax.errors.JaxRuntimeError(ERROR)\n",
    )
    c = base_config()
    c.sampling.denoise_rows = rows
    text = _raised(rollout["_rollout_program"], c)
    assert f"sampling.denoise_rows={lower}" in text, text
    c.sampling.denoise_rows = devices  # one row a device: nothing lower to offer
    assert "sampling.denoise_rows" not in _raised(rollout["_rollout_program"], c)
