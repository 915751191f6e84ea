"""The program store: keyed by code, config and arguments; a damaged file is a miss in one
line; a stored program computes what the traced one does, bit for bit, and is lowered ahead
exactly as it will be (the same program for JAX's cache)."""

import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small_configs import small_config

from tree_grpo_jax import sharding
from tree_grpo_jax.core import rollout
from tree_grpo_jax.run import program_store


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def _step(depth, state, x, scale):
    """A small program with what the run's have: a static argument, a donated one, a tree,
    a Python scalar, float arithmetic whose rounding a changed program would change."""
    h = x
    for _ in range(depth):
        h = jnp.tanh(h @ state["w"] + state["b"]) * scale
    new = {"w": state["w"] - 1e-3 * (h.T @ x), "b": state["b"] + h.mean(axis=0)}
    return new, {"out": h, "norm": jnp.sqrt((h**2).sum())}


def _inputs(seed=0, rows=5):
    rng = np.random.default_rng(seed)
    state = {"w": rng.standard_normal((3, 3), np.float32), "b": rng.standard_normal(3, np.float32)}
    return state, rng.standard_normal((rows, 3)).astype(np.float32), 0.7


def _placed(mesh, rows=5):
    """`_inputs` as a run passes them: the state on the mesh, the rows split over it (as
    shapes, the way the run lowers its train step), a Python scalar."""
    state, x, scale = _inputs(rows=rows)
    state = jax.device_put(state, sharding.replicated(mesh))
    rows = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.batch_sharding(mesh))
    return state, rows, scale


def _exported(depth=2, rows=5):
    state, x, scale = _inputs(rows=rows)
    return rollout.staged(_step, export=True)(depth, state, x, scale)


def _stored(name="train_step", depth=2):
    """A `StoredProgram` lowered once, as a run's are before they are stored."""
    program = program_store.exported_program(name, lambda: _exported(depth))[name]
    program.lower(*_inputs())
    return program


DEPTHS = dict(zip(program_store.DUE, (1, 2, 3)))  # three programs that differ


def _write(directory, name, run_key="r" * 64):
    programs = {n: _stored(n, depth) for n, depth in DEPTHS.items()}
    program_store.write(directory, name, run_key, programs)
    return programs


def test_the_key_follows_the_code_the_config_and_the_arguments(monkeypatch):
    config = small_config("treegrpo")
    arguments = _inputs()
    base = program_store.key(config, arguments)
    assert program_store.key(config.copy_and_resolve_references(), _inputs()) == base

    def changed(edit):
        c = config.copy_and_resolve_references()
        edit(c)
        return program_store.key(c, arguments), program_store.file_key(c)

    # settings that reach a program change the keys; where a run reports and saves does not
    file_key = program_store.file_key(config)
    for edit in (
        lambda c: setattr(c.sampling, "num_steps", 5),
        lambda c: setattr(c.train, "clip_range", 0.1),
        lambda c: setattr(c.tree, "k", 3),
    ):
        assert all(a != b for a, b in zip(changed(edit), (base, file_key)))
    for edit in (
        lambda c: setattr(c, "name", "another"),
        lambda c: setattr(c.log, "progress", True),
        lambda c: setattr(c.checkpoint, "every", 7),
    ):
        assert changed(edit) == (base, file_key)
    # another shape, dtype, tree or placement of the arguments: another run key, same file
    state, x, scale = arguments
    assert program_store.key(config, (state, x[:4], scale)) != base
    assert program_store.key(config, (state, x.astype(np.float16), scale)) != base
    assert program_store.key(config, ({"w": state["w"]}, x, scale)) != base
    assert program_store.key(config, (state, jax.device_put(x, jax.devices()[0]), scale)) != base
    # the package's code
    monkeypatch.setattr(program_store, "code_digest", lambda: "0" * 64)
    assert program_store.key(config, arguments) != base
    assert program_store.file_key(config) != file_key


def test_the_code_digest_reads_the_package_sources():
    digest = program_store.code_digest()
    assert len(digest) == 64 and digest == program_store.code_digest()


def test_a_stored_program_computes_what_the_traced_one_does(tmp_path):
    _write(tmp_path, "k" * 64)
    stored = program_store.read(tmp_path, "k" * 64)
    assert stored.key == "r" * 64 and set(stored.programs) == set(program_store.DUE)
    program = stored.programs["train_step"]
    assert program.donate_argnums == (0,)  # the run's train step donates its state
    state, x, scale = _inputs()
    expected = jax.device_get(_step(DEPTHS["train_step"], jax.device_put(state), x, scale))
    got = jax.device_get(program(jax.device_put(state), x, scale))
    jax.tree.map(np.testing.assert_array_equal, got, expected)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    # a program of other shapes is another program: the stored one refuses them
    with pytest.raises(Exception, match="shape"):
        program(jax.device_put(state), np.zeros((4, 3), np.float32), scale)


def test_a_program_is_lowered_ahead_as_it_will_be_lowered():
    """`lower_ahead` (before the arguments exist) gives the very program the run's own
    lowering gives: JAX's compilation cache then answers both with one entry."""
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    program = program_store.exported_program("train_step", lambda: _exported(2))["train_step"]
    text = program.lower(*_placed(mesh)).as_text()
    assert program.lower_ahead(mesh).as_text() == text
    # what the arguments' placement says is part of it: unplaced rows lower another program
    state, rows, scale = _placed(mesh)
    other = program_store.StoredProgram(program.exported, (0,))
    unplaced = jax.ShapeDtypeStruct(rows.shape, rows.dtype)
    assert other.lower(state, unplaced, scale).as_text() != text


def test_stored_programs_load_early_and_run_once(tmp_path, capsys):
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    _write(tmp_path, "e" * 64)
    early = program_store.EarlyPrograms(tmp_path, "e" * 64, mesh)
    stored = early.result()
    assert stored is not None and set(stored.programs) == set(program_store.DUE)
    assert program_store.EarlyPrograms(tmp_path, "n" * 64, mesh).result() is None  # none
    assert capsys.readouterr().err == ""


def test_a_damaged_file_is_one_line_and_a_miss(tmp_path, capsys):
    key = "d" * 64
    _write(tmp_path, key)
    path = tmp_path / f"{key}{program_store.SUFFIX}"
    whole = path.read_bytes()
    assert program_store.read(tmp_path, "e" * 64) is None  # none stored: silent
    assert capsys.readouterr().err == ""
    for damaged in (
        whole[: len(whole) // 2],  # truncated
        whole[:-1] + bytes([whole[-1] ^ 1]),  # one bit changed
        b"",
        b"not a programs file",
    ):
        path.write_bytes(damaged)
        assert program_store.read(tmp_path, key) is None
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "damaged" in err and str(path) in err
    # another key's whole file under this name: a miss too
    path.write_bytes(whole)
    (tmp_path / f"{'f' * 64}{program_store.SUFFIX}").write_bytes(whole)
    assert program_store.read(tmp_path, "f" * 64) is None
    capsys.readouterr()
    assert program_store.read(tmp_path, key) is not None


def test_a_program_jax_cannot_export_is_traced_and_said_once(capsys):
    def refused():
        raise ValueError("Cannot serialize code with custom calls\nwhose targets are unstable")

    assert program_store.exported_program("rollout", refused) == {}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rollout is not stored" in err and "custom calls" in err
    made = program_store.exported_program("train_step", _exported)
    assert made["train_step"].donate_argnums == (0,)


def test_writers_at_once_leave_one_whole_file(tmp_path):
    programs = {n: _stored(n, depth) for n, depth in DEPTHS.items()}
    errors = []

    def write():
        try:
            for _ in range(3):
                program_store.write(tmp_path, "w" * 64, "r" * 64, programs)
        except Exception as e:  # pragma: no cover - the assertion below reports it
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{'w' * 64}{program_store.SUFFIX}"]
    assert set(program_store.read(tmp_path, "w" * 64).programs) == set(program_store.DUE)


def test_the_most_recently_used_files_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(program_store, "MAX_ENTRIES", 2)
    for i, key in enumerate(("a" * 64, "b" * 64)):
        _write(tmp_path, key)
        long_ago = 1_000_000 + i
        os.utime(tmp_path / f"{key}{program_store.SUFFIX}", (long_ago, long_ago))
    program_store.read(tmp_path, "a" * 64)  # used now: the newest
    # what a process killed while writing left: gone an hour later, not before
    (tmp_path / ".old.partial").write_bytes(b"x")
    os.utime(tmp_path / ".old.partial", (1_000_000, 1_000_000))
    (tmp_path / ".new.partial").write_bytes(b"x")
    _write(tmp_path, "c" * 64)
    kept = sorted(p.name[0] for p in tmp_path.glob(f"*{program_store.SUFFIX}"))
    assert kept == ["a", "c"]
    assert not (tmp_path / ".old.partial").exists() and (tmp_path / ".new.partial").exists()


def test_the_store_lives_beside_the_compilation_cache(tmp_path):
    names = ("jax_compilation_cache_dir", "jax_enable_compilation_cache")
    saved = {name: getattr(jax.config, name) for name in names}
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
        jax.config.update("jax_enable_compilation_cache", True)
        assert program_store.folder() == tmp_path / "jax" / program_store.FOLDER
        jax.config.update("jax_enable_compilation_cache", False)
        assert program_store.folder() is None
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)


def test_a_process_of_a_multi_host_job_loads_nothing_before_it_joins(tmp_path, monkeypatch):
    """Reading the store's key starts JAX's backend (`jax.devices()`), which a process of a
    job must not do before `jax.distributed.initialize`: it waits for the run's build."""
    (tmp_path / program_store.FOLDER).mkdir()
    monkeypatch.setattr(program_store, "folder", lambda: tmp_path / program_store.FOLDER)
    touched = []
    monkeypatch.setattr(program_store, "file_key", lambda config: touched.append(config))
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1")
    program_store.start_early("a config")
    assert touched == []
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")  # one host: not a job
    with pytest.raises(AttributeError):  # got past the guard, to the config's mesh
        program_store.start_early("a config")
    assert touched == ["a config"]
