"""How many workers `pytest -n auto` (pyproject's addopts) starts: tests/conftest.py's hook."""

import os

import conftest
import pytest

GIB = 2**30


@pytest.mark.parametrize(
    "cores, memory_gib, workers",
    [(2, 24, 2), (1, 24, 1), (64, 256, 4), (64, 24, 3), (8, 12, 1), (8, 4, 1)],
)
def test_one_worker_per_core_capped_at_four_and_one_per_8_gib(
    monkeypatch, cores, memory_gib, workers
):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": memory_gib * GIB // 4096}
    monkeypatch.setattr(os, "sysconf", pages.__getitem__)
    assert conftest.pytest_xdist_auto_num_workers(None) == workers


def test_the_environment_variable_is_left_to_pytest_xdist(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert conftest.pytest_xdist_auto_num_workers(None) is None
