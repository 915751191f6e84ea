"""Session-wide test settings: XLA's optimization level, one persistent compilation cache,
the tiny random SD1.5, SD3 and FLUX folders (written with PyTorch once per run and never
written into: a test that breaks one breaks a copy), the loaded SD1.5 model, and, under CI, a
failure for every test skipped for a missing package (ci_imports.py).

The tests are in three folders: unit/ (one module's maths or checks against an independent
reference), parity/ (our Flax models, converters and exports against the PyTorch releases
built tiny and random), integration/ (runs, commands, processes and files end to end)."""

import os
import shutil

import pytest
from ci_imports import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401

pytest_plugins = ["pytester"]  # test_ci_imports.py runs pytest on small test folders

# pyproject's addopts run the suite with `-n auto --dist loadscope`: worker processes, each
# test module on one worker (its module fixtures built once), each worker its own session
# (the compile cache and the tiny model folders below are shared by the run's workers).
MAX_WORKERS = 4  # more only repeats the session fixtures; the longest module bounds the run
# A worker peaked at 5.0 GiB, and at 9.4 GiB with the 3 processes test_data_parallel.py starts
# beside it (2 workers on 2 cores): 8 GiB a worker leaves room for one such module.
GIB_PER_WORKER = 8


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """How many workers `-n auto` starts: one per core this process may use, at most
    MAX_WORKERS and one per GIB_PER_WORKER of memory (2 on a 2-core, 24 GiB machine).
    PYTEST_XDIST_AUTO_NUM_WORKERS, when set, decides instead (pytest-xdist reads it)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):  # no sysconf: the cores decide
        memory_gib = GIB_PER_WORKER * MAX_WORKERS
    return max(1, min(cores or 1, MAX_WORKERS, int(memory_gib // GIB_PER_WORKER)))


# The tests run tiny models, where XLA's optimization passes take longer than the programs
# they speed up: skip most of them (here and in the command-line runs the tests start, which
# inherit the environment). Set before the first JAX import reads it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


def _written_once(tmp_path_factory, name: str, write):
    """The folder `write(folder)` fills, once per run: in one process a fresh temporary
    folder; under pytest-xdist the first worker to ask writes it in the folder the run's
    workers share (their basetemps' parent) while the others wait on its lock."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return write(tmp_path_factory.mktemp(name))
    from filelock import FileLock  # torch's and huggingface_hub's dependency

    root = tmp_path_factory.getbasetemp().parent
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed halfway
            folder.mkdir(mode=0o700)  # as mktemp makes it
            write(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def sd_folder(tmp_path_factory):
    pytest.importorskip("torch")
    from sd_fixtures import make_tiny_sd_folder

    return _written_once(tmp_path_factory, "tiny_sd", make_tiny_sd_folder)


@pytest.fixture(scope="session")
def sd3_folder(tmp_path_factory):
    pytest.importorskip("torch")
    from sd3_fixtures import make_tiny_sd3_folder

    return _written_once(tmp_path_factory, "tiny_sd3", make_tiny_sd3_folder)


@pytest.fixture(scope="session")
def flux_folder(tmp_path_factory):
    pytest.importorskip("torch")
    from flux_fixtures import make_tiny_flux_folder

    return _written_once(tmp_path_factory, "tiny_flux", make_tiny_flux_folder)


@pytest.fixture(scope="session")
def zimage_folder(tmp_path_factory):
    pytest.importorskip("torch")
    from zimage_fixtures import make_tiny_zimage_folder

    return _written_once(tmp_path_factory, "tiny_zimage", make_tiny_zimage_folder)


@pytest.fixture(scope="session")
def qwenimage_folder(tmp_path_factory):
    pytest.importorskip("torch")
    from qwenimage_fixtures import make_tiny_qwenimage_folder

    return _written_once(tmp_path_factory, "tiny_qwenimage", make_tiny_qwenimage_folder)


@pytest.fixture(scope="session")
def flux2_dev_folder(tmp_path_factory):
    pytest.importorskip("torch")
    from flux2_fixtures import make_tiny_flux2_folder

    return _written_once(
        tmp_path_factory, "tiny_flux2_dev", lambda path: make_tiny_flux2_folder(path, "dev")
    )


@pytest.fixture(scope="session")
def flux2_klein_folder(tmp_path_factory):
    pytest.importorskip("torch")
    from flux2_fixtures import make_tiny_flux2_folder

    return _written_once(
        tmp_path_factory, "tiny_flux2_klein", lambda path: make_tiny_flux2_folder(path, "klein")
    )


@pytest.fixture(scope="session")
def sd_model(sd_folder):
    from tree_grpo_jax.models.sd15.load import load_sd

    return load_sd(str(sd_folder))


@pytest.fixture(scope="session", autouse=True)
def shared_compile_cache(tmp_path_factory):
    """One persistent compilation cache for the whole session (and the command-line runs it
    starts): the many small trainings compile the same programs, and a hit skips XLA. The
    workers of one run share it (their basetemps' common parent), as the processes of one
    test already do: an entry another worker is still writing fails to read, and JAX warns
    and compiles it."""
    from tree_grpo_jax.run import compile_cache

    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "jax_compile_cache"
        folder.mkdir(exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("jax_compile_cache")
    os.environ[compile_cache.ENV_DIR] = str(folder)
    compile_cache.enable(folder)
    yield folder


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """After each test module, the programs JAX compiled for it are dropped: the suite runs in
    one process, and a thousand tests' executables otherwise stay resident to its end."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
