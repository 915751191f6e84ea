"""Fixtures shared by the SD loading and export tests: one tiny random SD folder (written
with PyTorch) and its loaded model, built once per session."""

import pytest


@pytest.fixture(scope="session")
def sd_folder(tmp_path_factory):
    pytest.importorskip("torch")
    from sd_fixtures import make_tiny_sd_folder

    return make_tiny_sd_folder(tmp_path_factory.mktemp("tiny_sd"))


@pytest.fixture(scope="session")
def sd_model(sd_folder):
    from tree_grpo_jax.models.sd15 import load_sd

    return load_sd(str(sd_folder))
