"""Checkpointer.restore sets a checkpoint aside only when its own files are damaged; a saved
state that does not fit the code's, a storage error or anything unexpected stops with one
sentence and every checkpoint keeps its name."""

import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import struct
from signalled import run_script

from tree_grpo_jax.run.checkpoint import Checkpointer, CheckpointError
from tree_grpo_jax.run.train_step import TrainState, make_optimizer

# A failed read leaves orbax's other array reads un-awaited; Python reports them when they are
# collected, in whichever test runs then.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <coroutine object _read_array_index_and_device_put"
    ":pytest.PytestUnraisableExceptionWarning"
)

TRAIN = ml_collections.ConfigDict(
    dict(
        max_grad_norm=1.0,
        adam_b1=0.9,
        adam_b2=0.999,
        adam_eps=1e-8,
        weight_decay=1e-4,
        grad_accumulation=2,  # optax.MultiSteps around a chain: named tuples in named tuples
        optimizer_state_dtype="float32",
    )
)


@struct.dataclass
class StateWithCounter:  # TrainState as it was, with a field since removed
    params: Any
    opt_state: Any
    updates: jax.Array


def make_state(scale=1.0, shape=(64, 32), dtype=jnp.float32):
    """Random values: they do not compress, so the kernel gets array files of its own (orbax
    inlines small values into its index)."""
    kernel = scale * jax.random.normal(jax.random.PRNGKey(0), shape)
    params = {"dense": {"kernel": kernel.astype(dtype), "bias": jnp.zeros(shape[1:], dtype)}}
    return TrainState(params, make_optimizer(TRAIN).init(params))


def expected_kernel(scale):
    return np.asarray(make_state(scale).params["dense"]["kernel"])


@pytest.fixture
def two_checkpoints(tmp_path):
    folder = tmp_path / "checkpoints"
    ckpt = Checkpointer(str(folder))
    ckpt.save(1, make_state(1.0), {"next_iteration": 1})
    ckpt.save(2, make_state(2.0), {"next_iteration": 2})
    ckpt.close()
    return folder


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def assert_one_sentence(error):
    text = str(error)
    assert "\n" not in text and text.endswith(".") and text.count(". ") == 0, text


def kernel(state):
    return np.asarray(state.params["dense"]["kernel"])


def test_restores_the_newest_into_the_target_and_as_saved(two_checkpoints):
    ckpt = Checkpointer(str(two_checkpoints))
    state, meta, step = ckpt.restore(make_state(0.0))
    assert step == 2 and meta == {"next_iteration": 2}
    assert isinstance(state, TrainState)
    np.testing.assert_array_equal(kernel(state), expected_kernel(2.0))
    np.testing.assert_array_equal(
        ckpt.restore_params(step=1)["dense"]["kernel"], expected_kernel(1.0)
    )
    assert names(two_checkpoints) == ["1", "2"]


TARGETS = {
    "a leaf more": lambda: StateWithCounter(
        make_state().params, make_state().opt_state, jnp.zeros((), jnp.int32)
    ),
    "a leaf less": lambda: TrainState(make_state().params, None),
    "another shape": lambda: make_state(shape=(64, 16)),
    "another dtype": lambda: make_state(dtype=jnp.bfloat16),
}


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("target", list(TARGETS))
def test_a_state_that_does_not_fit_stops_and_renames_nothing(two_checkpoints, target, read_only):
    ckpt = Checkpointer(str(two_checkpoints), read_only=read_only)
    with pytest.raises(CheckpointError, match="holds another training state") as info:
        ckpt.restore(TARGETS[target]())
    assert_one_sentence(info.value)
    assert "checkpoint 2" in str(info.value) and "no checkpoint was changed" in str(info.value)
    assert names(two_checkpoints) == ["1", "2"]


def test_a_run_saved_with_its_blocks_one_by_one_names_scan_layers(tmp_path):
    """A checkpoint of unscanned blocks (a run from before model.scan_layers) restored into
    a scanned model's state, and the other way round: one sentence naming the flag."""
    one_by_one = TrainState(
        {f"transformer_blocks_{i}": {"kernel": jnp.full((3, 2), i, jnp.float32)} for i in (0, 1)},
        None,
    )
    stacked = TrainState({"transformer_blocks_0_to_1": {"kernel": jnp.zeros((2, 3, 2))}}, None)
    for saved, target, flag in ((one_by_one, stacked, False), (stacked, one_by_one, True)):
        ckpt = Checkpointer(str(tmp_path / f"saved_{flag}"))
        ckpt.save(1, saved, {})
        with pytest.raises(CheckpointError, match="holds another training state") as info:
            ckpt.restore(target)
        assert_one_sentence(info.value)
        assert f"resume it with --config.model.scan_layers={flag} (no checkpoint" in str(info.value)
        assert names(tmp_path / f"saved_{flag}") == ["1"]


def test_the_message_names_what_differs(two_checkpoints):
    ckpt = Checkpointer(str(two_checkpoints))
    with pytest.raises(CheckpointError, match="it lacks updates, which this code has"):
        ckpt.restore(StateWithCounter(make_state().params, make_state().opt_state, jnp.int32(0)))
    with pytest.raises(CheckpointError, match=r"its params.dense.kernel is \(64, 32\) float32 "):
        ckpt.restore(make_state(shape=(64, 16)))
    # A checkpoint written with the field, restored by code without it (TrainState.updates).
    old = Checkpointer(str(two_checkpoints.parent / "old"))
    old.save(1, StateWithCounter(make_state().params, make_state().opt_state, jnp.int32(3)), {})
    with pytest.raises(CheckpointError, match="it has updates, which this code does not"):
        old.restore(make_state())
    assert names(two_checkpoints.parent / "old") == ["1"]


def _biggest_array_file(step_dir):
    """The biggest of the files holding array data (the kernel's): under the state's `d/`
    folders, beside orbax's JSON metadata and index files."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    biggest = max(files, key=lambda p: p.stat().st_size)
    assert biggest.stat().st_size > 4000  # the kernel's data, not an index
    return biggest


@pytest.mark.parametrize("damage", ["truncated", "garbled", "meta gone"])
def test_a_damaged_newest_is_set_aside_and_the_older_restored(two_checkpoints, damage, capsys):
    step_dir = two_checkpoints / "2"
    biggest = _biggest_array_file(step_dir)
    if damage == "truncated":
        biggest.write_bytes(biggest.read_bytes()[:10])
    elif damage == "garbled":
        biggest.write_bytes(bytes(255 - b for b in biggest.read_bytes()))
    else:
        (step_dir / "meta" / "metadata").unlink()
    state, meta, step = Checkpointer(str(two_checkpoints)).restore(make_state(0.0))
    assert step == 1 and meta == {"next_iteration": 1}
    np.testing.assert_array_equal(kernel(state), expected_kernel(1.0))
    assert "warning: checkpoint 2" in capsys.readouterr().err
    kept = names(two_checkpoints)
    assert kept[0] == "1" and kept[1].startswith("2.unreadable-") and len(kept) == 2


@pytest.mark.parametrize("read_only", [False, True])
def test_a_damaged_step_asked_for_names_the_intact_ones(two_checkpoints, read_only):
    biggest = _biggest_array_file(two_checkpoints / "2")
    biggest.write_bytes(biggest.read_bytes()[:10])
    with pytest.raises(CheckpointError) as info:
        Checkpointer(str(two_checkpoints), read_only=read_only).restore(make_state(0.0), step=2)
    assert_one_sentence(info.value)
    assert str(info.value).startswith(f"checkpoint 2 in {two_checkpoints} cannot be read (")
    assert "; it also holds 1: ask for one of those." in str(info.value)


def test_a_damaged_newest_in_a_read_only_folder_is_skipped_not_renamed(two_checkpoints):
    biggest = _biggest_array_file(two_checkpoints / "2")
    biggest.write_bytes(biggest.read_bytes()[:10])
    params = Checkpointer(str(two_checkpoints), read_only=True).restore_params()
    np.testing.assert_array_equal(params["dense"]["kernel"], expected_kernel(1.0))
    assert names(two_checkpoints) == ["1", "2"]


def _permission_denied_by_tensorstore():
    try:  # as orbax reports it: a bare Exception raised from tensorstore's ValueError
        raise ValueError('PERMISSION_DENIED: Error reading "params.w/0.0": Permission denied')
    except ValueError as e:
        raise Exception("Encountered error while reading array index") from e  # noqa: TRY002


def _raise(error):
    def restore(*args, **kwargs):
        if callable(error):
            error()
        raise error

    return restore


STORAGE_ERRORS = {
    "PermissionError": PermissionError(13, "Permission denied", "/checkpoints/2/meta"),
    "tensorstore PERMISSION_DENIED": _permission_denied_by_tensorstore,
    "ConnectionError": ConnectionError("connection reset by peer"),
}


@pytest.mark.parametrize("error", list(STORAGE_ERRORS))
def test_a_storage_error_stops_and_renames_nothing(two_checkpoints, monkeypatch, error):
    monkeypatch.setattr(ocp.CheckpointManager, "restore", _raise(STORAGE_ERRORS[error]))
    with pytest.raises(CheckpointError, match="a storage problem rather than a damaged") as info:
        Checkpointer(str(two_checkpoints)).restore(make_state())
    assert_one_sentence(info.value)
    assert names(two_checkpoints) == ["1", "2"]


def test_an_unexpected_error_stops_and_renames_nothing(two_checkpoints, monkeypatch):
    monkeypatch.setattr(ocp.CheckpointManager, "restore", _raise(TypeError("an API changed")))
    with pytest.raises(CheckpointError, match="TypeError: an API changed") as info:
        Checkpointer(str(two_checkpoints)).restore(make_state())
    assert_one_sentence(info.value)
    assert names(two_checkpoints) == ["1", "2"]


def test_read_meta_stops_on_a_storage_error(two_checkpoints, monkeypatch):
    monkeypatch.setattr(ocp.CheckpointManager, "restore", _raise(STORAGE_ERRORS["PermissionError"]))
    with pytest.raises(CheckpointError, match="a storage problem"):
        Checkpointer(str(two_checkpoints)).read_meta()
    assert names(two_checkpoints) == ["1", "2"]


def _readable(path) -> bool:
    try:
        os.listdir(path) if path.is_dir() else path.read_bytes()
    except PermissionError:
        return False
    return True


@pytest.mark.parametrize("unreadable", ["2", "2/state", "2/meta/metadata", "array file"])
def test_files_storage_will_not_open_stop_the_restore(two_checkpoints, unreadable):
    """Real permissions (chmod 0): orbax reads some metadata leniently, so the refusal is
    looked for before anything is set aside."""
    if unreadable == "array file":
        path = _biggest_array_file(two_checkpoints / "2")
    else:
        path = two_checkpoints / unreadable
    mode = path.stat().st_mode
    path.chmod(0)
    try:
        if _readable(path):
            pytest.skip("this user reads files whatever their permissions (root)")
        with pytest.raises(CheckpointError, match="a storage problem") as info:
            Checkpointer(str(two_checkpoints)).restore(make_state())
        assert "Permission" in str(info.value) or "PERMISSION" in str(info.value)
        assert names(two_checkpoints) == ["1", "2"]
    finally:
        path.chmod(mode)


SIGNAL_IN_THE_SAVE = """
import sys
import jax.numpy as jnp
from tree_grpo_jax import interrupts
from tree_grpo_jax.run.checkpoint import Checkpointer

interrupts.install()
folder = sys.argv[1]
interrupts.set_stop_line(lambda name: f"{name}: steps {Checkpointer(folder).all_steps()}")
ckpt = Checkpointer(folder)
# the signal arrives while the checkpoint is being written
ckpt._manager.wait_until_finished = signalled(ckpt._manager.wait_until_finished)
ckpt.save(1, {"kernel": jnp.arange(4096.0)}, {"next_iteration": 1})
print("the save returned", flush=True)
"""


def test_a_signal_in_the_save_waits_for_the_checkpoint(tmp_path):
    folder = tmp_path / "checkpoints"
    result = run_script(SIGNAL_IN_THE_SAVE, str(folder))
    assert result.returncode == 143, result.stderr[-2000:]
    assert "error: SIGTERM: steps [1]" in result.stderr
    assert "the save returned" not in result.stdout  # it stopped at the save's end
    assert names(folder) == ["1"]
