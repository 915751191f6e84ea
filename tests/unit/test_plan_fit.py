"""`plan`'s memory verdicts (cli/fit.py) on made-up totals: each accelerator against its
data sheet's memory, JAX's 75% share held back on GPUs only; the mesh estimated to fit."""

import dataclasses

import ml_collections
import pytest

from tree_grpo_jax.plan import accelerators, fit

GIB = 2**30


def _targets(*names, sizes=()):
    return fit.targets([accelerators.ACCELERATORS[n] for n in names], sizes)


def test_each_accelerator_gets_its_own_verdict():
    checked = _targets("tpu-v5e", "h100", "tpu-v5p", "b200", sizes=[70])
    # 70 GB: above a v5e's 16 GB; above 75% of an H100's 80 GB (60) but within it; within a
    # v5p's 95 GB (a TPU keeps no share back); within 75% of a B200's 180 GB (135)
    verdicts = {v.target.label: v for v in fit.verdicts(70e9, checked)}
    assert [(v.fits, v.fits_default) for v in verdicts.values()] == [
        (False, False),
        (True, False),
        (True, True),
        (True, True),
        (True, False),  # a bare size is read as a GPU's memory
    ]
    assert verdicts["tpu-v5e"].sentence() == "does not fit 16 GB (Google TPU v5e)"
    assert (
        verdicts["h100"]
        .sentence()
        .startswith("fits 80 GB (NVIDIA H100 SXM) only with XLA_PYTHON_CLIENT_MEM_FRACTION")
    )
    assert verdicts["tpu-v5p"].sentence() == "fits 95 GB (Google TPU v5p)"


def test_a_custom_accelerator_has_no_memory_to_check():
    custom = accelerators.accelerator("custom", 100, 1)
    assert fit.targets([custom], []) == []


@dataclasses.dataclass
class _Program:
    name: str
    total: int
    temp: int = 0


@dataclasses.dataclass
class _Plan:
    devices: int
    mesh: dict
    resident: dict
    programs: tuple


def _config(batch=4, rows=8, data=-1, denoise_rows=0):
    return ml_collections.ConfigDict(
        dict(
            mesh=dict(data=data, fsdp=1),
            prompts=dict(batch_size=batch),
            train=dict(rows_per_minibatch=rows),
            sampling=dict(denoise_rows=denoise_rows),
        )
    )


def test_the_suggested_mesh_divides_the_weights_and_keeps_the_rest():
    # 300 GiB of weights and optimizer state; the train step's temporaries: 100 GiB of
    # gradients and new moments (up to the state's size) and 30 GiB else; 2 devices, fsdp 1
    state = {"trained params": 60 * GIB, "optimizer state": 240 * GIB, "rollout tree": GIB}
    step = _Program("train_step", 430 * GIB, temp=130 * GIB)
    rollout = _Program("rollout", 310 * GIB, temp=10 * GIB)  # no gradients: state alone
    plan = _Plan(2, {"data": 2, "fsdp": 1}, state, (rollout, step))
    h100 = _targets("h100")[0]  # 60e9 bytes usable by default
    s = fit.suggest(plan, _config(), h100, 4096)
    # by hand: the step keeps 430 - 300 - 130 = 0 GiB and splits 430, the rollout keeps 10
    # and splits 300; at fsdp 8 they need 53.75 and 47.5 GiB, within 60e9 bytes (55.9 GiB);
    # at fsdp 4 the step's 107.5 GiB is not
    assert (s.devices, s.fsdp) == (8, 8)
    assert s.estimate == pytest.approx(430 * GIB / 8)
    assert 430 * GIB / 8 <= 60e9 < 430 * GIB / 4
    assert s.flags == (
        "--devices=8",
        "--config.mesh.fsdp=8",
        "--config.prompts.batch_size=8",
    )
    assert "8 devices at mesh.fsdp=8 need about 53.75 GiB per device" in s.sentence()
    # denoise_rows (0: a whole level, kept) raised to a multiple of the batch shards too
    assert fit.suggest(plan, _config(denoise_rows=2), h100, 4096).flags[-1] == (
        "--config.sampling.denoise_rows=8"
    )
    assert fit.suggest(plan, _config(denoise_rows=16), h100, 4096).flags == s.flags
    # a mesh.data set by hand is freed for the new fsdp
    assert "--config.mesh.data=-1" in fit.suggest(plan, _config(data=2), h100, 4096).flags
    # on the planned devices when fsdp suffices there: 430 / f GiB <= 135e9 bytes at f = 4
    plan4 = dataclasses.replace(plan, devices=4, mesh={"data": 4, "fsdp": 1})
    on_four = fit.suggest(plan4, _config(), _targets("b200")[0], 4096)
    assert (on_four.devices, on_four.fsdp) == (4, 4)
    # mesh.sequence keeps its devices: fsdp shares what it leaves, and so do the batches
    paired = dataclasses.replace(plan, devices=4, mesh={"data": 2, "fsdp": 1, "sequence": 2})
    s = fit.suggest(paired, _config(), h100, 4096)
    assert (s.devices, s.fsdp) == (16, 8)
    assert s.flags == ("--devices=16", "--config.mesh.fsdp=8", "--config.prompts.batch_size=8")


def test_no_mesh_when_the_rest_alone_is_too_big():
    state = {"trained params": GIB}
    plan = _Plan(1, {"data": 1, "fsdp": 1}, state, (_Program("train_step", 30 * GIB),))
    s = fit.suggest(plan, _config(), _targets("tpu-v5e")[0], 4096)
    assert s.devices == 0 and s.flags == ()
    assert "mesh.fsdp alone would not" in s.sentence()
    assert s.as_json()["devices"] is None
