"""The persistent compilation cache: where it goes, and that a compile lands in it."""

import pathlib

import jax
import jax.numpy as jnp
import pytest

from tree_grpo_jax.run import compile_cache

OPTIONS = (
    "jax_compilation_cache_dir",
    "jax_enable_compilation_cache",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@pytest.fixture
def restore_jax_config():
    saved = {name: getattr(jax.config, name) for name in OPTIONS}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compile_cache._reset()


def test_default_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == tmp_path / "xdg" / "tree_grpo_jax" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_dir() == pathlib.Path(
        tmp_path / "home" / ".cache" / "tree_grpo_jax" / "jax"
    )
    monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "mine"))
    assert compile_cache.default_dir() == tmp_path / "mine"


def test_enable_writes_compiled_programs_to_the_folder(tmp_path, restore_jax_config):
    folder = compile_cache.enable(tmp_path / "cache", min_compile_time_s=0.0)
    assert folder == tmp_path / "cache" and folder.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(folder)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0

    @jax.jit
    def program(x):
        return jnp.sin(x) * 3.0 + jnp.cos(x).sum()

    program(jnp.arange(17.0)).block_until_ready()
    assert any(folder.iterdir()), "the compile was not written to the cache"

    compile_cache.disable()
    assert not jax.config.jax_enable_compilation_cache
