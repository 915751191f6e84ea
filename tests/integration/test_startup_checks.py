"""What a run checks before it writes anything: the prompts against the model and the
rewards, the rewards' output shape, and the memory of its compiled programs; and the output
streams that survive a reader that has gone."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from in_process import one_error_line, run_main

from tree_grpo_jax import config as cfg
from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.run import precompile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def bad_shape_reward():
    """A reward giving [B, 1] instead of [B], registered for one test."""
    name = "bad_shape_for_test"
    reward_registry.register(name, lambda images, prompts: np.zeros((len(images), 1)), True)
    yield name
    reward_registry._REGISTRY.pop(name, None)


@pytest.mark.parametrize(
    "lines, expected",
    [
        (["draw a seven"] * 3 + ["a photo of " + "very " * 12 + "big seven"], "words"),
        (["draw a seven", "draw a cat"], "names no digit"),
    ],
)
def test_a_prompt_the_run_cannot_read_is_one_sentence_and_nothing_is_written(
    tmp_path, lines, expected
):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lines) + "\n")
    workdir = tmp_path / "new" / "run"
    result = run_main(
        "--config=configs/tiny.py",
        f"--config.prompts.source={prompts}",
        f"--workdir={workdir}",
    )
    line = one_error_line(result)
    assert "prompts.source" in line and expected in line, line
    assert not (tmp_path / "new").exists()


def test_a_reward_of_the_wrong_shape_is_named_before_anything_is_written(
    tmp_path, bad_shape_reward
):
    workdir = tmp_path / "runs" / "x"
    result = run_main(
        "--config=configs/tiny.py", f"--config.rewards={bad_shape_reward}", f"--workdir={workdir}"
    )
    line = one_error_line(result)
    assert bad_shape_reward in line and "returned scores of shape (" in line, line
    assert "one score per image" in line, line
    assert not (tmp_path / "runs").exists()


def test_compiled_memory_is_read_from_xla():
    """A program's peak from XLA's analysis covers its argument and output buffers."""
    x = jnp.zeros((1024, 256), jnp.float32)  # 1 MiB
    lowered = {"rollout": jax.jit(lambda a: (a @ a.T).sum(axis=0)).lower(x)}
    fits = precompile.compile_programs(lowered, {"rollout": 123})
    fit = fits["rollout"]
    assert fit.argument == x.nbytes
    assert fit.peak >= x.nbytes + 1024 * 4  # the argument and the [1024] output at least
    assert fit.total == fit.peak + 123


def _config(batch_size=8, eval_count=10, rows=32):
    from configs import tiny

    config = tiny.get_config()
    config.prompts.batch_size = batch_size
    config.prompts.eval_count = eval_count
    config.train.rows_per_minibatch = rows
    return config


def test_a_rollout_too_large_names_the_largest_batch_that_fits():
    gib = 2**30
    # 1 GiB of weights, 8 prompts taking 8 GiB more, 1 GiB held: 10 GiB; 6 GiB fit 4 prompts
    fits = {"rollout": precompile.ProgramFit("rollout", 9 * gib, gib, gib, 1.0)}
    with pytest.raises(cfg.ConfigError) as e:
        precompile.check_fits(_config(), fits, 1, 6 * gib, "GPU memory")
    text = str(e.value)
    assert "10 GiB" in text and "6 GiB of GPU memory" in text, text
    assert "prompts.batch_size=4 would fit" in text, text
    # over two devices each holds 4 prompts; 2 per device fit: 4 in all
    with pytest.raises(cfg.ConfigError, match=r"batch_size=4 would fit"):
        fits2 = {"rollout": precompile.ProgramFit("rollout", 5 * gib, gib, gib, 1.0)}
        precompile.check_fits(_config(), fits2, 2, 4 * gib, "GPU memory")
    # when not even one prompt fits, the tree's own size is what to lower
    with pytest.raises(cfg.ConfigError, match="even one prompt's tree does not fit"):
        precompile.check_fits(_config(), fits, 1, int(2.5 * gib), "GPU memory")
    precompile.check_fits(_config(), fits, 1, 10 * gib, "GPU memory")  # fits exactly


def test_when_none_fits_a_video_model_names_the_settings_that_size_its_samples():
    from configs import wan_branchgrpo

    gib = 2**30
    config = wan_branchgrpo.get_config()
    config.prompts.batch_size, config.prompts.eval_count = 8, 10
    for name in ("rollout", "evaluation", "train step"):
        fits = {name: precompile.ProgramFit(name, 9 * gib, gib, gib, 1.0)}
        with pytest.raises(cfg.ConfigError) as e:
            precompile.check_fits(config, fits, 1, int(2.5 * gib), "GPU memory")
        text = str(e.value)
        assert "model.wan.resolution=(240, 416) or model.wan.num_frames=33" in text, text
    # an image model has no such settings: the sentence keeps to the tree
    fits = {"rollout": precompile.ProgramFit("rollout", 9 * gib, gib, gib, 1.0)}
    with pytest.raises(cfg.ConfigError) as e:
        precompile.check_fits(_config(), fits, 1, int(2.5 * gib), "GPU memory")
    assert str(e.value).endswith("or tree.group_size."), str(e.value)


def test_an_eval_or_train_step_too_large_names_its_own_setting():
    gib = 2**30
    evaluate = {"evaluation": precompile.ProgramFit("evaluation", 11 * gib, gib, 0, 1.0)}
    with pytest.raises(cfg.ConfigError, match="at most 5 eval samples"):
        precompile.check_fits(_config(eval_count=10), evaluate, 1, 6 * gib, "host memory")
    step = {"train step": precompile.ProgramFit("train step", 9 * gib, gib, 0, 1.0)}
    with pytest.raises(cfg.ConfigError, match=r"rows_per_minibatch=16 would fit.*remat"):
        precompile.check_fits(_config(rows=32), step, 1, 5 * gib, "host memory")


def test_cpu_devices_share_the_host_memory():
    limit, where = precompile.memory_limit()
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    devices = jax.local_devices()
    if devices[0].platform == "cpu":
        assert limit == host // len(devices)
        assert "host memory" in where


SCRIPT = """
import os, sys, time
from tree_grpo_jax.run import reporting
reporting.survive_closed_streams()
time.sleep(0.5)  # the reader has gone by now
for i in range(2000):
    print("progress line", i, flush=True)
    print("warning", i, file=sys.stderr, flush=True)
open(sys.argv[1], "w").write("saved")
"""


def test_output_survives_a_reader_that_has_gone(tmp_path):
    """`... | tee log` then Ctrl-C: tee dies first; the run's prints must not raise."""
    marker = tmp_path / "saved"
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(marker)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.close()  # both readers leave before the first line
    process.stderr.close()
    assert process.wait(timeout=120) == 0
    assert marker.read_text() == "saved"


def _folder_with(tmp_path, source, component: str, change) -> str:
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    path = folder / component / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    "component, change",
    [
        ("unet", lambda c: c.pop("block_out_channels")),  # the default does not fit the weights
        ("unet", lambda c: c.update(block_out_channels="wide")),
        ("text_encoder", lambda c: c.update(hidden_size="wide")),
    ],
)
def test_a_model_folder_whose_configs_do_not_build_is_one_sentence(
    tmp_path, sd_folder, component, change
):
    folder = _folder_with(tmp_path, sd_folder, component, change)
    workdir = tmp_path / "runs" / "sd"
    result = run_main(
        "--config=configs/sd15.py", f"--config.model.path={folder}", f"--workdir={workdir}"
    )
    line = one_error_line(result)
    assert folder in line and "config" in line, line
    assert not (tmp_path / "runs").exists()


def test_a_reward_folder_whose_config_does_not_build_is_one_sentence(tmp_path):
    pytest.importorskip("torch")
    from clip_fixtures import make_clip_folder

    folder = tmp_path / "clip"
    make_clip_folder(folder)
    folder = _folder_with(
        tmp_path, folder, ".", lambda c: c["vision_config"].update(hidden_size="wide")
    )
    result = run_main(
        "--config=configs/tiny.py",
        "--config.rewards=clip_score",
        f"--config.reward_models.clip_score={folder}",
        f"--workdir={tmp_path / 'runs' / 'x'}",
    )
    line = one_error_line(result)
    assert "clip_score" in line and folder in line, line
    assert not (tmp_path / "runs").exists()


def test_a_checkpoint_url_without_its_filesystem_package_is_one_sentence(tmp_path):
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed: the URL would be reached")
    result = run_main(
        "--config=configs/tiny.py",
        "--config.checkpoint.dir=gs://no-such-bucket/run",
        f"--workdir={tmp_path / 'runs' / 'x'}",
    )
    line = one_error_line(result)
    assert "gcsfs" in line and "pip install gcsfs" in line, line
    assert not (tmp_path / "runs").exists()


def test_an_xla_out_of_memory_becomes_one_sentence():
    from tree_grpo_jax.config import base_config
    from tree_grpo_jax.run.out_of_memory import OutOfMemory, out_of_memory

    error = RuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 28.80GiB.\n"
        "BufferAssignment OOM Debugging ..."
    )
    config = base_config()
    oom = out_of_memory(error, config)
    assert isinstance(oom, OutOfMemory)
    text = str(oom)
    assert "\n" not in text and "(28.80GiB)" in text, text
    # no program on the traceback: the settings of every program, none of the checkpoints
    assert "in one of the run's programs" in text and "checkpoint" not in text, text
    assert out_of_memory(RuntimeError("INTERNAL: something else"), config) is None
    # an out-of-the-ordinary setting is named first
    config.lora.rank = 100_000
    text = str(out_of_memory(error, config))
    assert "lora.rank=100000 is the likely cause" in text and "\n" not in text, text
    config.lora.rank = 32
    assert "lora.rank" not in str(out_of_memory(error, config))


@pytest.mark.parametrize("kernel, devices", [("cudnn", "NVIDIA GPUs"), ("pallas", "TPUs")])
def test_an_attention_kernel_this_platform_lacks_is_named_before_anything_is_written(
    tmp_path, kernel, devices
):
    assert jax.default_backend() == "cpu"
    workdir = tmp_path / "runs" / "x"
    result = run_main(
        "--config=configs/tiny.py", f"--config.model.attention={kernel}", f"--workdir={workdir}"
    )
    assert one_error_line(result) == (
        f"error: model.attention={kernel} is the fused kernel of {devices}, but this run's "
        "devices are CPUs; set --config.model.attention=auto (each platform's best) or "
        "blockwise (any platform)."
    )
    assert not (tmp_path / "runs").exists()


def test_an_attention_backend_the_unet_does_not_run_is_refused(tmp_path, sd_folder):
    workdir = tmp_path / "runs" / "sd"
    result = run_main(
        "--config=configs/sd15.py",
        f"--config.model.path={sd_folder}",
        "--config.model.attention=blockwise",
        f"--workdir={workdir}",
    )
    line = one_error_line(result)
    assert line.startswith("error: model.attention 'blockwise' is not available for Stable "), line
    assert line.endswith("set --config.model.attention=xla."), line
    assert not (tmp_path / "runs").exists()
