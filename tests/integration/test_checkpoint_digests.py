"""Checkpoints record a digest of every array they save and check it on restore: bits changed
on disk (in files that still read cleanly) set the checkpoint aside like any damage, the
digest is the same whatever the mesh the arrays lie on, and checkpoints saved without
digests restore as before.

Run as a script (`python tests/integration/test_checkpoint_digests.py OUT`) on several
simulated devices, it saves a sharded state and restores it on one device and on another mesh."""

import json
import logging
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from absl import logging as absl_logging

from tree_grpo_jax.run import checkpoint, digests
from tree_grpo_jax.run.checkpoint import DIGESTS_KEY, Checkpointer, state_digests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MASK = 2**32 - 1


def random_floats(seed, shape):
    """Random bits with the exponent's top bit cleared (no NaN or infinity): they do not
    compress, so a flipped byte changes a value instead of breaking a compressed block."""
    bits = jax.random.bits(jax.random.PRNGKey(seed), shape, jnp.uint32)
    return jax.lax.bitcast_convert_type(bits & jnp.uint32(0xBFFFFFFF), jnp.float32)


def make_state(seed):
    return {
        "params": {"kernel": random_floats(seed, (64, 64)), "bias": jnp.zeros(64)},
        "step": jnp.int32(seed),
    }


@pytest.fixture
def two_checkpoints(tmp_path):
    folder = tmp_path / "checkpoints"
    ckpt = Checkpointer(str(folder))
    ckpt.save(1, make_state(1), {"next_iteration": 1})
    ckpt.save(2, make_state(2), {"next_iteration": 2})
    ckpt.close()
    return folder


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def flip_64_bytes(step_dir):
    """Inverts 64 bytes in the middle of the biggest array data file (the kernel's), keeping
    its size."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    biggest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    assert len(data) > 16000  # the kernel's 16 KiB, not an index
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(255 - b for b in data[middle : middle + 64])
    biggest.write_bytes(bytes(data))


def read_saved_state(step_dir):
    """The state as orbax alone reads it, with no digest checked."""
    return ocp.StandardCheckpointer().restore(step_dir.resolve() / "state")


def warning_lines(err):
    return [line for line in err.splitlines() if line.startswith("warning:")]


def test_flipped_bytes_set_the_newest_aside_and_the_older_is_restored(two_checkpoints, capsys):
    flip_64_bytes(two_checkpoints / "2")
    # orbax reads the flipped file without complaint, values changed: only the digest tells.
    unchecked = np.asarray(read_saved_state(two_checkpoints / "2")["params"]["kernel"])
    changed = unchecked.view(np.uint32) != np.asarray(make_state(2)["params"]["kernel"]).view(
        np.uint32
    )
    assert 0 < changed.sum() <= 17
    capsys.readouterr()

    state, meta, step = Checkpointer(str(two_checkpoints)).restore(make_state(0))
    assert step == 1 and meta == {"next_iteration": 1}
    np.testing.assert_array_equal(state["params"]["kernel"], make_state(1)["params"]["kernel"])
    [line] = warning_lines(capsys.readouterr().err)
    assert line.startswith(f"warning: checkpoint 2 in {two_checkpoints} ")
    assert "params.kernel" in line
    kept = names(two_checkpoints)
    assert kept[0] == "1" and kept[1].startswith("2.unreadable-") and len(kept) == 2


def test_flipped_bytes_in_a_read_only_folder_are_skipped_and_nothing_renamed(
    two_checkpoints, capsys
):
    flip_64_bytes(two_checkpoints / "2")
    params = Checkpointer(str(two_checkpoints), read_only=True).restore_params()
    np.testing.assert_array_equal(params["kernel"], make_state(1)["params"]["kernel"])
    [line] = warning_lines(capsys.readouterr().err)
    assert "checkpoint 2" in line and "params.kernel" in line
    assert names(two_checkpoints) == ["1", "2"]


def reference_digest(array: np.ndarray) -> list[int]:
    """The digest over a host array, in 64-bit arithmetic over its flattened words, reduced
    modulo 2**32 at the end."""
    array = np.ascontiguousarray(array)
    if array.dtype == np.bool_:
        words = array.astype(np.uint64)
    else:
        unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[array.dtype.itemsize]
        words = array.view(unsigned).astype(np.uint64)
    words = words.ravel()
    mixed = (np.arange(words.size, dtype=np.uint64) * 0x9E3779B9) & MASK
    mixed = ((mixed ^ (mixed >> np.uint64(16))) * 0x85EBCA6B) & MASK
    weighted = (words * (mixed | np.uint64(1))) & MASK
    return [int(words.sum()) & MASK, int(weighted.sum()) & MASK]


def mixed_dtype_tree():
    key = jax.random.PRNGKey(7)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {
        "f32": random_floats(3, (33, 7)),
        "bf16": jax.random.normal(k1, (5, 3, 9)).astype(jnp.bfloat16),
        "int32": jax.lax.bitcast_convert_type(jax.random.bits(k2, (257,)), jnp.int32),
        "bool": jax.random.bernoulli(k3, 0.5, (4, 129)),
        "int32 scalar": jax.random.randint(k4, (), -(2**31), 2**31 - 1, jnp.int32),
    }


def recorded_digests(step_dir) -> dict:
    """The digests in a saved meta document, read as the JSON file it is."""
    return json.loads((step_dir / "meta" / "metadata").read_text())[DIGESTS_KEY]


def test_the_device_digest_matches_a_host_reference_over_the_saved_arrays(tmp_path):
    tree = mixed_dtype_tree()
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, tree, {})
    ckpt.close()
    saved = jax.tree_util.tree_map(np.asarray, read_saved_state(tmp_path / "1"))
    assert {k: str(v.dtype) for k, v in saved.items()} == {
        "f32": "float32",
        "bf16": "bfloat16",
        "int32": "int32",
        "bool": "bool",
        "int32 scalar": "int32",
    }
    reference = {name: reference_digest(array) for name, array in saved.items()}
    assert recorded_digests(tmp_path / "1") == reference
    assert state_digests(tree) == reference


def test_a_single_changed_word_changes_the_digest():
    kernel = random_floats(5, (16, 16))
    before = state_digests([kernel])["0"]
    for index in [(0, 0), (7, 3), (15, 15)]:
        changed = kernel.at[index].set(kernel[index] + 1.0)
        assert state_digests([changed])["0"] != before, index
    swapped = kernel.at[0, 0].set(kernel[0, 1]).at[0, 1].set(kernel[0, 0])
    assert state_digests([swapped])["0"] != before


def test_leaves_that_are_not_arrays_are_left_out():
    tree = {
        "w": jnp.ones(3),
        "count": 3,
        "scale": np.float32(2.0),
        "host": np.arange(4, dtype=np.int32),
    }
    assert set(state_digests(tree)) == {"w", "host"}
    assert state_digests(tree)["host"] == reference_digest(np.arange(4, dtype=np.int32))


def test_a_checkpoint_saved_without_digests_restores_unchecked(two_checkpoints, capsys):
    meta_file = two_checkpoints / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta[DIGESTS_KEY]
    meta_file.write_text(json.dumps(meta))
    ckpt = Checkpointer(str(two_checkpoints))
    state, meta, step = ckpt.restore(make_state(0))
    assert step == 2 and meta == {"next_iteration": 2}
    np.testing.assert_array_equal(state["params"]["kernel"], make_state(2)["params"]["kernel"])
    assert ckpt.read_meta() == {"next_iteration": 2}
    assert capsys.readouterr().err == ""
    assert names(two_checkpoints) == ["1", "2"]


def test_meta_comes_back_as_saved(two_checkpoints):
    ckpt = Checkpointer(str(two_checkpoints))
    assert DIGESTS_KEY in json.loads((two_checkpoints / "2" / "meta" / "metadata").read_text())
    assert ckpt.read_meta() == {"next_iteration": 2}
    assert ckpt.restore(None, step=1)[1] == {"next_iteration": 1}


def test_orbax_warns_no_more_of_waiting_for_a_previous_save(tmp_path, monkeypatch, caplog):
    """orbax counts each save's own wait as the next one's wait for the previous save; with
    its threshold lowered it would warn on every save."""
    monkeypatch.setattr(ocp.checkpoint_manager, "_WAIT_FOR_PREV_SAVE_WARNING_THRESHOLD_SECS", -1.0)
    dropped = []
    original = checkpoint._NoPreviousSaveWait.filter

    def spy(self, record):
        keep = original(self, record)
        if not keep:
            dropped.append(record.getMessage())
        return keep

    monkeypatch.setattr(checkpoint._NoPreviousSaveWait, "filter", spy)
    with caplog.at_level(logging.WARNING):
        ckpt = Checkpointer(str(tmp_path))
        ckpt.save(1, make_state(1), {})
        ckpt.save(2, make_state(2), {})
        ckpt.close()
        absl_logging.warning("another orbax warning")
    assert dropped and all(m.startswith("Waiting for previous save") for m in dropped)
    logged = [r.getMessage() for r in caplog.records]
    assert "another orbax warning" in logged
    assert not any("Waiting for previous save" in m for m in logged)


@pytest.mark.slow
def test_the_digests_do_not_depend_on_the_mesh(tmp_path):
    """Saved from a state sharded over 2x2 simulated devices, restored on one device and onto
    a 4x1 mesh: the same digests everywhere, and no warning."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": ROOT,
    }
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not warning_lines(out.stderr), out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    assert all(count > 1 for count in result["distinct_shards"].values()), result
    saved = result["saved"]
    assert set(saved) == {"params.w", "params.v", "params.b", "flags", "counts"}
    for other in ("recorded", "one_device", "other_mesh", "reference"):
        assert result[other] == saved, other
    # the program a pod's processes run over their shards gives the host's sums, on either mesh
    assert result["device_square"] == saved and result["device_line"] == saved


def _sharded_round_trip(folder: pathlib.Path) -> dict:
    """Saves a state laid out on a 2x2 mesh, restores it as saved (one device) and onto a 4x1
    mesh; the digests of each."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices())
    square = Mesh(devices.reshape(2, 2), ("data", "fsdp"))
    line = Mesh(devices.reshape(4, 1), ("data", "fsdp"))
    tree = mixed_dtype_tree()
    layout = {  # leaf -> (value, spec on the square mesh, spec on the line)
        "params": {
            "w": (random_floats(11, (8, 12)), P(None, "fsdp"), P("data", None)),
            "v": (tree["bf16"].reshape(15, 9)[:12, :8], P("data", "fsdp"), P(None, "data")),
            "b": (random_floats(12, (12,)), P("fsdp"), P("data")),
        },
        "flags": (tree["bool"][:, :128], P("data", "fsdp"), P(None, "data")),
        "counts": (tree["int32"][:256].reshape(16, 16), P(("data", "fsdp")), P()),
    }
    is_entry = lambda x: isinstance(x, tuple)  # noqa: E731
    on_square = jax.tree_util.tree_map(
        lambda e: jax.device_put(e[0], NamedSharding(square, e[1])), layout, is_leaf=is_entry
    )
    on_line = jax.tree_util.tree_map(
        lambda e: jax.device_put(jnp.zeros_like(e[0]), NamedSharding(line, e[2])),
        layout,
        is_leaf=is_entry,
    )
    saved = state_digests(on_square)
    ckpt = Checkpointer(str(folder))
    ckpt.save(1, on_square, {})
    one_device, _, _ = ckpt.restore(None)
    assert all(len(leaf.sharding.device_set) == 1 for leaf in jax.tree_util.tree_leaves(one_device))
    other_mesh, _, _ = ckpt.restore(on_line)
    ckpt.close()
    # one process holds every shard, so NumPy gathers the whole arrays
    host = {path: np.asarray(leaf) for path, leaf in digests.named_leaves(on_square)}

    def on_device(tree):  # the sharded path: one program over the arrays where they lie
        named = digests.named_leaves(tree)
        sums = np.asarray(digests._digest_leaves([leaf for _, leaf in named]))
        return {path: [int(a), int(b)] for (path, _), (a, b) in zip(named, sums)}

    return {
        "device_square": on_device(on_square),
        "device_line": on_device(other_mesh),
        "devices": jax.device_count(),
        "distinct_shards": {
            path: len({str(shard.index) for shard in leaf.addressable_shards})
            for path, leaf in digests.named_leaves(on_square)
        },
        "saved": saved,
        "recorded": recorded_digests(folder / "1"),
        "one_device": state_digests(one_device),
        "other_mesh": state_digests(other_mesh),
        "reference": {path: reference_digest(array) for path, array in host.items()},
    }


if __name__ == "__main__":
    print(json.dumps(_sharded_round_trip(pathlib.Path(sys.argv[1]))))
