"""Command line: `python -m tree_grpo_jax.main --config=configs/tiny.py [--config.a.b=value]`.

A restart with the same `--workdir` resumes from its last checkpoint. Bad input ends with one
sentence on stderr and exit status 2; a failure during training keeps the last checkpoint.
"""

from __future__ import annotations

import datetime
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).")
WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where metrics, pictures and checkpoints go (default runs/<name>/<time>)."
)

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def _fail(message: str, status: int) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def default_workdir(name: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", name, stamp)


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax reports every file it writes at INFO
    # Imported here so that `--help` and flag errors answer before JAX starts.
    from tree_grpo_jax import config as cfg
    from tree_grpo_jax import train
    from tree_grpo_jax.checkpoint import CheckpointError

    config = CONFIG.value
    if config is None:
        _fail("give a config file, e.g. --config=configs/tiny.py.", EXIT_BAD_INPUT)
    workdir = WORKDIR.value or default_workdir(config.get("name", "run"))
    bad_input = [cfg.ConfigError, CheckpointError, FileNotFoundError]
    try:
        from tree_grpo_jax.models.sd import ModelLoadError

        bad_input.append(ModelLoadError)
    except ImportError:  # pragma: no cover - the SD path is optional at import time
        pass
    try:
        summary = train.train(config, workdir)
    except tuple(bad_input) as e:
        _fail(str(e), EXIT_BAD_INPUT)
    except ValueError as e:
        # Prompt files, reward names, shapes of user inputs: reported as one sentence.
        _fail(str(e).splitlines()[0] if str(e) else repr(e), EXIT_BAD_INPUT)
    except train.RewardError as e:
        _fail(
            f"{e} Progress up to the last finished iteration is in {workdir}/checkpoints.",
            EXIT_FAILED,
        )
    except KeyboardInterrupt:
        _fail(f"interrupted; progress is saved in {workdir}/checkpoints.", 130)

    print(
        f"done: eval reward {summary['first_eval_reward']:.4f} -> "
        f"{summary['last_eval_reward']:.4f} "
        f"in {summary['wall_time_s']:.0f}s; {summary['rollout_denoiser_calls_per_leaf']:.2f} "
        f"denoiser calls per leaf\n"
        f"  samples before: {summary['first_grid']}\n"
        f"  samples after:  {summary['last_grid']}\n"
        f"  reward curve:   {summary['reward_curve']}\n"
        f"  metrics:        {os.path.join(workdir, 'metrics.jsonl')}",
        flush=True,
    )


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
