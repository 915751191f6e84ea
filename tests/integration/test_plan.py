"""`python -m tree_grpo_jax.plan`: every program of a run compiled from shapes, with XLA's
per-device memory; a model folder's JSON files are all it reads; FSDP divides the train
step's state; bad input is one sentence and exit status 2.

Expectations are counted independently: parameters from the weights a loader would read (the
tiny model's random weights, the safetensors files of the SD folders), optimizer bytes by hand
(float32 params and Adam's two float32 moments: 12 bytes per parameter)."""

import json
import math
import os
import shutil
import subprocess
import sys

import jax
import pytest

from tree_grpo_jax.plan.command import SIMULATED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAMS = {"rollout", "train_step", "evaluate", "decode"}
# Small runs: a 4-step tree with a 2-step window, a few prompts and rows.
SMALL = [
    "--config.sampling.num_steps=4",
    "--config.tree.window=2",
    "--config.prompts.batch_size=2",
    "--config.prompts.eval_count=2",
    "--config.train.rows_per_minibatch=4",
]
TINY = ["--config=configs/tiny.py", *SMALL]


def run_plan(*args) -> subprocess.CompletedProcess:
    """The command's own parsing and entry point, in this process (on one device: more would
    start the command again)."""
    from in_process import run_in_process

    from tree_grpo_jax.plan import command as plan

    # each flag is given once: a test's own --devices (a bad one) replaces the 1
    devices = [] if any(a.split("=")[0] == "--devices" for a in args) else ["--devices=1"]
    return run_in_process(plan, *devices, *args, prog="tree_grpo_jax.plan")


def plan_json(*args) -> dict:
    result = run_plan(*args, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    return lines[0]


def tiny_unet_parameters() -> int:
    from tree_grpo_jax.models.tiny.networks import random_weights

    return sum(a.size for a in jax.tree.leaves(random_weights(0)["unet"]))


def safetensors_parameters(folder, drop=()) -> int:
    """Scalars in a folder's safetensors files, read from their headers."""
    from safetensors import safe_open

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "np") as f:
            names = [k for k in f.keys() if k not in drop]  # noqa: SIM118 - not a dict
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in names)
    return total


def json_only(folder, tmp_path):
    """A copy of `folder` in which every file but the JSON ones holds garbage."""
    copy = tmp_path / f"{folder.name}_json_only"
    shutil.copytree(folder, copy)
    for file in copy.rglob("*"):
        if file.is_file() and file.suffix != ".json":
            file.write_bytes(b"not what this file should hold")
    return copy


def _check_programs(plan, names=PROGRAMS):
    assert set(plan["programs"]) == names
    for name, p in plan["programs"].items():
        assert p["argument_bytes"] > 0 and p["output_bytes"] > 0, name
        peak = p["argument_bytes"] + p["output_bytes"] + p["temp_bytes"] - p["alias_bytes"]
        assert p["peak_bytes"] == peak > 0, name
        assert p["total_bytes"] == peak + p["held_bytes"], name


def test_tiny_plan_has_every_program_and_the_train_state():
    plan = plan_json(*TINY)
    _check_programs(plan)
    n = tiny_unet_parameters()
    assert plan["parameters"] == plan["trained_parameters"] == n
    assert plan["devices"] == 1 and plan["mesh"] == {"data": 1, "fsdp": 1}
    step = plan["programs"]["train_step"]
    assert step["argument_bytes"] >= 12 * n  # fp32 params and Adam's two fp32 moments
    assert step["alias_bytes"] >= 12 * n  # the donated state is updated in place
    assert plan["programs"]["rollout"]["argument_bytes"] >= 4 * n
    assert plan["sample_shape"] == [1, 8, 8]
    assert plan["largest_total_bytes"] == max(p["total_bytes"] for p in plan["programs"].values())
    # checked against the default accelerator's memory (an H100's 80 GB) alone
    assert plan["fits"] == {"h100": True} and plan["memory_checked_gb"] == {"h100": 80}
    assert plan["suggestions"] == [] and plan["time"][0]["runnable"] is True


def test_the_fit_is_checked_against_each_accelerator_named():
    """One verdict per accelerator, against its data sheet's memory (here, and in the
    JSON), and one per --device_memory size beside them."""
    args = ["--programs=train_step", "--accelerator=h100,tpu-v5p,tpu-v5e", "--device_memory=40"]
    result = run_plan(*TINY, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "fits 80 GB (NVIDIA H100 SXM), fits 95 GB (Google TPU v5p), fits 16 GB (Google TPU "
        "v5e), fits 40 GB per device" in result.stdout
    )
    plan = plan_json(*TINY, *args)
    assert plan["memory_checked_gb"] == {"h100": 80, "tpu-v5p": 95, "tpu-v5e": 16, "40": 40}
    assert all(plan["fits"].values()) and len(plan["fits"]) == 4


# The tiny run's train step (29.3 MB) against sizes it does not fit: by the estimate 28 MB
# holds it at mesh.fsdp=2, 18 MB at mesh.fsdp=8, and 10 MB not even what fsdp does not divide.
TINY_TOO_BIG = [
    *TINY,
    "--programs=train_step",
    "--accelerator=custom",
    "--peak_tflops=100",
    "--bandwidth=1",
    "--device_memory=0.028,0.018,0.01",
]


def test_a_run_that_fits_nothing_gets_no_hours_and_a_mesh_that_would():
    result = run_plan(*TINY_TOO_BIG)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    assert "does not fit 0.028 GB, does not fit 0.018 GB, does not fit 0.01 GB per" in text
    assert "nothing fits: the run as planned fits none of the memories checked" in text
    assert "NOT RUNNABLE as planned on 1 device" in text and " iterations: " not in text
    plan = plan_json(*TINY_TOO_BIG)
    assert plan["fits"] == {"0.028": False, "0.018": False, "0.01": False}
    (time,) = plan["time"]
    assert time["runnable"] is False and time["hours"] is None
    assert time["seconds_per_iteration"] > 0  # the iteration's estimate is still given
    # The estimate by hand (ZeRO-3's accounting): the weights, Adam's moments, and the step's
    # gradients and new moments (its temporaries up to the weights' and moments' size) split
    # over mesh.fsdp, the rest as it is.
    state = plan["held_bytes"]["trained params"] + plan["held_bytes"]["optimizer state"]
    step = plan["programs"]["train_step"]
    split = state + min(step["temp_bytes"], state)
    rest = step["total_bytes"] - split

    def at(fsdp):
        return rest + split / fsdp

    fits, more, too_small = plan["suggestions"]
    assert (fits["devices"], fits["fsdp"]) == (2, 2)
    assert fits["estimated_total_bytes"] == pytest.approx(at(2))
    assert at(2) <= 0.75 * 0.028e9 < step["total_bytes"]
    assert fits["flags"] == ["--devices=2", "--config.mesh.fsdp=2"]  # 2 divides the batches
    assert (more["devices"], more["fsdp"]) == (8, 8)
    assert at(8) <= 0.75 * 0.018e9 < at(4)
    # the batches are raised to a multiple of the 8 devices the rows split over
    assert more["flags"] == [
        "--devices=8",
        "--config.mesh.fsdp=8",
        "--config.prompts.batch_size=8",
        "--config.train.rows_per_minibatch=8",
    ]
    assert f"in place of this command line's own: {' '.join(more['flags'])}." in text
    assert too_small["devices"] is None and rest > 0.75 * 0.01e9
    assert "to fit 0.01 GB: mesh.fsdp alone would not" in text


@pytest.mark.slow
def test_the_suggested_meshes_fit_when_planned():
    """The meshes suggested for 28 MB and 18 MB, planned on 2 and 8 simulated devices, fit
    them, within the estimate (which errs high)."""
    suggestions = plan_json(*TINY_TOO_BIG)["suggestions"][:2]
    procs = [
        _plan_process(*TINY_TOO_BIG[len(TINY) :], *s["flags"], env=dict(os.environ))
        for s in suggestions
    ]
    for suggestion, proc in zip(suggestions, procs):
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        plan = json.loads(stdout)
        fsdp = suggestion["fsdp"]
        assert plan["devices"] == fsdp and plan["mesh"] == {"data": 1, "fsdp": fsdp}
        assert plan["fits_default_gpu_share"][suggestion["target"]]
        assert plan["largest_total_bytes"] <= suggestion["estimated_total_bytes"]


@pytest.mark.slow
def test_sd35_on_one_device_gets_a_verdict_per_accelerator():
    """SD3.5 Medium's full fine-tuning on one device (its train step, 61.0 GiB = 65.5 GB by
    docs/plan.md): above a TPU v5e's 16 GB, above JAX's 75% of an H100's 80 GB, within a TPU
    v5p's 95 GB (no share held back on a TPU); hours only where it fits."""
    result = run_plan(
        "--config=configs/sd35m.py",
        "--programs=train_step",
        "--accelerator=tpu-v5e,h100,tpu-v5p",
        "--json",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    total = plan["largest_total_bytes"]
    assert 0.75 * 80e9 < total < 80e9  # the premise: between an H100's default share and all
    assert plan["fits"] == {"tpu-v5e": False, "h100": True, "tpu-v5p": True}
    assert plan["fits_default_gpu_share"] == {"tpu-v5e": False, "h100": False, "tpu-v5p": True}
    assert plan["suggestions"] == []  # some accelerator named holds it
    runnable = {t["accelerator"]["name"]: (t["runnable"], t["hours"]) for t in plan["time"]}
    assert runnable["tpu-v5e"] == (False, None)
    assert runnable["h100"][0] and runnable["tpu-v5p"][0] and runnable["h100"][1] > 0


@pytest.mark.slow
def test_lora_plan_trains_only_the_factors():
    from tree_grpo_jax.models.tiny.networks import random_weights

    rank = 4
    kernels = [
        leaf.shape
        for path, leaf in jax.tree_util.tree_leaves_with_path(random_weights(0)["unet"])
        if path[-1].key == "kernel"
        and leaf.ndim == 2
        and path[-2].key in ("to_q", "to_k", "to_v", "to_out_0")
    ]
    factors = sum(rank * (fan_in + fan_out) for fan_in, fan_out in kernels)
    result = run_plan(*TINY, f"--config.lora.rank={rank}", "--device_memory=0.0001,80")
    assert result.returncode == 0, result.stderr[-3000:]
    plan = plan_json(*TINY, f"--config.lora.rank={rank}", "--config.model.compute_dtype=bfloat16")
    _check_programs(plan)
    n = tiny_unet_parameters()
    assert plan["trained_parameters"] == factors and plan["parameters"] == n
    step = plan["programs"]["train_step"]
    assert step["argument_bytes"] >= 2 * n + 12 * factors  # the frozen base and the factors
    assert step["alias_bytes"] < 2 * n  # only the factors' state is updated in place
    assert plan["held_bytes"]["LoRA base"] == 2 * n  # held in the compute dtype, bfloat16
    assert "LoRA rank 4 (frozen base bfloat16), params float32" in plan["training"]
    # a CPU compile says that it leaves out the float32 copies of bfloat16 weights
    assert any("loop-invariant code motion off" in note for note in plan["notes"])
    # the table says what it measured and what does not fit
    for name in PROGRAMS:
        assert f"\n{name} " in result.stdout
    assert "fits 80 GB (NVIDIA H100 SXM), does not fit 0.0001 GB, fits 80 GB" in result.stdout
    assert "LoRA rank 4" in result.stdout


@pytest.mark.slow
def test_diffusion_nft_plan_counts_the_old_policy():
    one_step_per_minibatch = "--config.train.updates_per_iteration=0"
    plan = plan_json("--config=configs/tiny_flow_nft.py", *SMALL, one_step_per_minibatch)
    _check_programs(plan)
    n = tiny_unet_parameters()
    assert plan["held_bytes"]["old policy"] == 4 * n
    step = plan["programs"]["train_step"]
    assert step["argument_bytes"] >= 16 * n  # the params, Adam's moments and the old policy
    assert step["alias_bytes"] >= 16 * n  # all of the donated state


@pytest.mark.slow
def test_sd_plan_reads_only_the_folders_json(sd_folder, tmp_path):
    folder = json_only(sd_folder, tmp_path)
    plan = plan_json(
        "--config=configs/sd15.py",
        *SMALL,
        f"--config.model.path={folder}",
        "--programs=rollout,decode",  # the UNet and the VAE; the tiny run compiles the rest
    )
    _check_programs(plan, {"rollout", "decode"})
    assert "train_step, evaluate (not asked for)" in plan["not_planned"]
    assert plan["parameters"] == safetensors_parameters(sd_folder / "unet")
    # the fixture's 8x8 latents of 4 channels and its CLIP: 16 positions of 32 features
    assert plan["sample_shape"] == [4, 8, 8]
    assert plan["cond_shape"] == [16, 32]
    assert plan["model"] == str(folder)


@pytest.mark.slow
def test_sd3_plan_reads_only_the_folders_json(sd3_folder, tmp_path):
    from sd3_fixtures import T5_WIDTH

    original = sd3_folder
    folder = json_only(original, tmp_path)
    plan = plan_json(
        "--config=configs/sd35m.py",
        *SMALL,
        f"--config.model.path={folder}",
        "--config.model.sd3.sample_size=8",
        "--config.model.sd3.t5_max_length=8",
    )
    _check_programs(plan)
    # diffusers saves the position table as a buffer: not a parameter
    expected = safetensors_parameters(original / "transformer", drop=("pos_embed.pos_embed",))
    assert plan["parameters"] == expected
    # CLIP's 77 tokens, 8 T5 tokens and the pooled vector, each as wide as T5
    assert plan["cond_shape"] == [77 + 8 + 1, T5_WIDTH]
    assert plan["sample_shape"] == [16, 8, 8]


def test_builtin_configs_are_the_releases():
    """SD1.5's UNet has 859.5M parameters and SD3.5 Medium's MMDiT 2.24B (their model cards);
    the text encoders give CLIP's 77 tokens of 768 (SD1.5) and 77 + 256 T5 tokens plus the
    pooled vector, 4096 wide (SD3.5)."""
    from ml_collections import ConfigDict

    from tree_grpo_jax.models import registry

    def model(name, path, **options):
        return ConfigDict(dict(name=name, path=path, compute_dtype="float32", **options))

    sd = registry.abstract_model(model("sd", "builtin:sd15"))
    assert round(sum(x.size for x in jax.tree.leaves(sd.params)) / 1e6, 1) == 859.5
    assert sd.cond_shape == (77, 768) and sd.sample_shape == (4, 64, 64)
    sd3_options = ConfigDict(dict(use_t5=True, t5_max_length=256, sample_size=64))
    sd3 = registry.abstract_model(
        model("sd3", "stabilityai/stable-diffusion-3.5-medium", sd3=sd3_options)
    )
    assert round(sum(x.size for x in jax.tree.leaves(sd3.params)) / 1e9, 2) == 2.24
    assert sd3.cond_shape == (77 + 256 + 1, 4096) and sd3.sample_shape == (16, 64, 64)
    assert sd3.source == "builtin:sd35m (stabilityai/stable-diffusion-3.5-medium)"


def _plan_process(*args, env):
    given = {a.split("=")[0] for a in args}  # a field is given once: these replace TINY's
    tiny = [a for a in TINY if a.split("=")[0] not in given]
    return subprocess.Popen(
        [sys.executable, "-m", "tree_grpo_jax.plan", *tiny, "--json", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_fsdp_divides_the_train_steps_state_on_4_simulated_devices():
    four = [
        "--programs=train_step",
        "--devices=4",
        "--config.prompts.batch_size=4",
        "--config.prompts.eval_count=4",
        "--config.train.rows_per_minibatch=4",
    ]
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    simulated = {**base, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    procs = {
        1: _plan_process(*four, "--config.mesh.fsdp=1", env=simulated),
        # no XLA_FLAGS: the command starts itself again on 4 simulated devices (the marker of
        # a restart, left set by hand, does not stop it)
        4: _plan_process(*four, "--config.mesh.fsdp=4", env={**base, SIMULATED: "1"}),
    }
    plans = {}
    for fsdp, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        plans[fsdp] = json.loads(stdout)
        assert plans[fsdp]["devices"] == 4 and plans[fsdp]["platform"] == "cpu"
        assert plans[fsdp]["mesh"] == {"data": 4 // fsdp, "fsdp": fsdp}
    state = 12 * tiny_unet_parameters()  # fp32 params + Adam's moments, unsharded
    args = {f: plans[f]["programs"]["train_step"]["argument_bytes"] for f in plans}
    assert args[1] >= state
    # The minibatch, prompts and schedule are laid out alike on both meshes: the difference is
    # the state, of which each device holds a quarter with fsdp=4.
    saved = args[1] - args[4]
    assert 0.95 * state * 3 / 4 <= saved <= state * 3 / 4


@pytest.mark.slow
def test_each_device_decodes_its_own_leaves_on_4_simulated_devices(sd3_folder, tmp_path):
    """The decode's per-device FLOPs are a quarter of one device's on 4 devices (a decoder
    looping over its rows once gathered all of them to every device, and the plan showed the
    same FLOPs on 1 and 4 devices)."""
    folder = json_only(sd3_folder, tmp_path)
    args = [
        "--config=configs/sd35m.py",
        f"--config.model.path={folder}",
        "--config.model.sd3.sample_size=8",
        "--config.model.sd3.t5_max_length=8",
        *[a for a in SMALL if "batch_size" not in a and "eval_count" not in a],
        "--config.prompts.batch_size=4",
        "--config.prompts.eval_count=4",
        "--programs=decode",
        "--json",
    ]
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = {
        n: subprocess.Popen(
            [sys.executable, "-m", "tree_grpo_jax.plan", *args, f"--devices={n}"],
            cwd=ROOT,
            env=base,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (1, 4)
    }
    flops = {}
    for n, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        plan = json.loads(stdout)
        assert plan["devices"] == n
        flops[n] = {name: p["flops"] for name, p in plan["programs"].items()}
        assert "split over 4 devices" in plan["programs"]["decode"]["what"] or n == 1
    assert flops[4]["decode"] == pytest.approx(flops[1]["decode"] / 4, rel=0.01)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config.model.name=sd", "--config.model.path=/nonexistent/sd15"], "/nonexistent/sd15"),
        (["--config.model.name=sd", "--config.model.path=builtin:sd99"], "'builtin:sd99'"),
        (["--devices=-3"], "--devices=-3 is not a device count to plan for; give a whole"),
        (["--devices=100000"], "--devices=100000"),
        (["--devices=1e3"], "--devices=1e3 is not a device count"),
        (["--devices=2.5"], "--devices=2.5 is not a device count"),
        (["--devices=nan"], "--devices=nan is not a device count"),
        (["--device_memory=eighty"], "--device_memory=eighty must be finite positive sizes"),
        (["--device_memory=80,inf"], "--device_memory=80,inf must be finite positive sizes"),
        (["--device_memory=nan"], "--device_memory=nan must be finite"),
        (["--device_memory=1e400"], "--device_memory=1e400 must be finite"),
        (["--device_memory=-80"], "--device_memory=-80 must be finite positive"),
        (["--device_memory="], "--device_memory= must be finite positive"),
        (["--config.tree.method=bogus"], "unknown tree.method 'bogus'"),
        (["--config.mesh.fsdp=3"], "mesh.fsdp=3 does not divide the 1 available device(s)"),
        (["--config.mesh.data=2", "--config.mesh.fsdp=-1"], "mesh.data=2 does not divide"),
        (["--config.eval.num_steps=5000"], "eval.num_steps must be in [1, 999], got 5000."),
        (["--config.sampling.num_steps=5000"], "sampling.num_steps must be in [1, 999]"),
        (["--config.no_such_field=1"], "no_such_field"),
        (["--programs=rollout,backward"], "unknown program 'backward'"),
        (["--accelerator=h101"], "unknown accelerator 'h101'; name one of h100, h200"),
        (["--accelerator=custom", "--peak_tflops=100"], "custom needs both --peak_tflops"),
        (["--accelerator=h100,a100", "--bandwidth=2"], "replace one accelerator's figures"),
        (["--peak_tflops=-5"], "--peak_tflops=-5 must be a finite positive number of TFLOP/s"),
        (["--peak_tflops=inf"], "--peak_tflops=inf must be a finite positive number of TFLOP/s"),
        (["--peak_tflops=nan"], "--peak_tflops=nan must be a finite positive number"),
        (["--peak_tflops=1e400"], "--peak_tflops=1e400 must be a finite positive number"),
        (["--peak_tflops=1e7"], "--peak_tflops=1e7 must be a finite positive number"),
        (["--peak_tflops=fast"], "--peak_tflops=fast must be a finite positive number"),
        (["--bandwidth=inf"], "--bandwidth=inf must be a finite positive number of TB/s"),
        (["--bandwidth=0"], "--bandwidth=0 must be a finite positive number of TB/s"),
        (["--interconnect=0"], "--interconnect=0 must be a finite positive number of GB/s"),
        (["--interconnect=nan"], "--interconnect=nan must be a finite positive number of GB/s"),
        (["--interconnect=1e400"], "--interconnect=1e400 must be a finite positive number"),
        (["--interconnect=fast"], "--interconnect=fast must be a finite positive number"),
        (["--accelerator=h100,a100", "--interconnect=2"], "replace one accelerator's figures"),
        (["--efficiency=1.5"], "--efficiency=1.5 must be a fraction of the roofline"),
        (["--efficiency=0"], "--efficiency=0 must be a fraction"),
        (["--efficiency=nan"], "--efficiency=nan must be a fraction"),
        (["--efficiency=inf"], "--efficiency=inf must be a fraction"),
        (["--efficiency=half"], "--efficiency=half must be a fraction"),
        (["--compare=grpo,gpro"], "--compare entry 'gpro' is neither a method"),
        (["--compare=configs/no_such.py"], "no_such.py"),
        (["--compare="], "--compare needs runs"),
        (["--compare=grpo,treegrpo", "--config.tree.group_size=0"], "grpo: "),
        (["--config.lora.rank=2", "--config.lora.targets=('no_such_module',)"], "LoRA targets"),
    ],
)
def test_bad_input_is_one_sentence(args, expected):
    given = {a.split("=")[0] for a in args}  # a field is given once: `args` replaces TINY's
    line = _one_error_line(run_plan(*[a for a in TINY if a.split("=")[0] not in given], *args))
    assert expected in line


def test_a_folder_without_a_config_is_one_sentence(sd_folder, tmp_path):
    folder = json_only(sd_folder, tmp_path)
    (folder / "unet" / "config.json").unlink()
    line = _one_error_line(
        run_plan("--config=configs/sd15.py", *SMALL, f"--config.model.path={folder}")
    )
    assert "has no unet/config.json" in line


def test_a_missing_config_file_is_one_sentence():
    line = _one_error_line(run_plan("--config=configs/no_such.py"))
    assert "no_such.py" in line
