"""Evaluate like the papers: base model against trained checkpoint, on fixed prompts and seeds.

    python -m tree_grpo_jax.evaluate --workdir=<a training run> [--step=N]
        [--prompts=FILE] [--samples_per_prompt=K] [--metrics=hpsv2,imagereward,...] [--out=DIR]
        [--normalised]
    python -m tree_grpo_jax.evaluate --config=configs/sd15.py --config.model.path=<folder> \\
        --out=DIR [--prompts=FILE] ...

A run is read as its `config.json` says (its base model, rewards and eval prompts) and its
checkpoint (the latest, or `--step`; opened read-only). Every prompt gets K fixed noises
(the run's `eval.seed`) and the deterministic sampler, as the training evaluation samples
them, its batch split over the devices; the training evaluation's own function measures
them (tree_grpo_jax/run/eval_metrics.py). Every metric (a registered reward's name; default:
the run's rewards and `eval.extra_rewards`) is scored on every sample; the diversity of a
prompt's K samples (tree_grpo_jax/evaluation/diversity.py) and, for a trained checkpoint, the
exact KL of its trajectories to the base model are reported beside them; for a video model
also each sample's temporal distance (the mean distance between its consecutive frames'
embeddings, tree_grpo_jax/evaluation/temporal.py).

When the prompts carry categories (a prompt file's category column or field,
docs/prompts-and-rewards.md), each metric's mean and std are also reported per category.
`--normalised` adds TreeGRPO's normalised score (r - r_base) / (r_max - r_base) of the
checkpoint for each metric with a stated r_max (tree_grpo_jax/evaluation/normalised.py).

The output folder (default `<workdir>/evaluation`) receives `evaluation.json` (`rows`: one
per model, each metric's mean and std, `diversity`, `temporal_distance` for videos,
`by_category` with categories; `categories`: each one's prompt count; `normalised`: r_max
and the scores), `evaluation.md` (the base-vs-trained table with the differences, then the
per-category and normalised tables) and one picture grid per
model (a column per prompt, a row per noise, the first ten prompts; a video model's cells
are strips of its frames, and the grid also moves in an animated GIF beside it). Results are
saved per chunk of prompts in `<out>/partial/`: a rerun with the same arguments continues
where the last one stopped. Bad input is one `error:` sentence and exit status 2, with
nothing written.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shlex
import shutil
import sys
import time

from tree_grpo_jax import interrupts
from tree_grpo_jax.cli import common
from tree_grpo_jax.cli import config_flag as cli
from tree_grpo_jax.cli.common import BadInput, check_out, run_config  # noqa: F401 - re-exported
from tree_grpo_jax.errors import echo, first_line, reason
from tree_grpo_jax.evaluation import normalised
from tree_grpo_jax.run import fingerprint as run_fingerprint

PARSER = cli.config_parser(
    "evaluate",
    __doc__,
    workdir_help="A training run's folder: its config.json and checkpoints, read-only.",
)
STEP = cli.define(
    PARSER, "step", None, "The run's checkpoint to evaluate (default: latest).", type=int
)
PROMPTS = cli.define(
    PARSER, "prompts", None, "A prompt file or built-in set (default: the run's eval prompts)."
)
SAMPLES = cli.define(
    PARSER, "samples_per_prompt", 4, "Fixed noises (samples) per prompt.", type=int, metavar="K"
)
METRICS = cli.define(
    PARSER,
    "metrics",
    None,
    "Comma-separated reward names (default: the run's rewards and extras).",
)
OUT = cli.define(PARSER, "out", None, "Output folder (default: <workdir>/evaluation).")
NORMALISED = cli.define(
    PARSER,
    "normalised",
    False,
    "Also TreeGRPO's normalised score (r - r_base) / (r_max - r_base) of the checkpoint.",
    action="store_true",
)
CHUNK = cli.define(
    PARSER, "prompts_per_chunk", 32, "Prompts per saved chunk of results.", type=int, metavar="N"
)

# The config fields this command's flags set, each with its flag: the sentences of the
# config's checks name the field (`_evaluation_config` sets them from the flags; and
# prompts.source from --prompts, when given).
TYPED = {
    "eval.samples_per_prompt": "--samples_per_prompt",
    "prompts.eval_count": "--prompts_per_chunk",
    "eval.extra_rewards": "--metrics",
}
GRID_PROMPTS = 10
TEMPORAL = "temporal_distance"  # a video model's figure (evaluation/temporal.py)


def _metric_names(config, text: str | None) -> list[str]:
    from tree_grpo_jax.rewards import families, registry

    if text is None:
        names = [*registry.parse_rewards(config.rewards), *config.eval.extra_rewards]
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise BadInput("--metrics names no metric; give reward names, e.g. --metrics=hpsv2.")
    known = registry.available_rewards()
    for name in names:
        if name not in known and not families.split_name(name):
            raise BadInput(f"unknown metric {name!r} in --metrics; known: {', '.join(known)}.")
        missing = registry.missing_weights(name, config.reward_models.get(name))
        if missing:
            raise BadInput(missing)
    unreachable = families.unreachable(names, config.reward_options)  # a served reward's server
    if unreachable:
        raise BadInput(unreachable)
    return list(dict.fromkeys(names))


class _Chunks:
    """Per-chunk results in `<out>/partial`, valid for one set of arguments."""

    def __init__(self, out: str, arguments: dict):
        self.folder = os.path.join(out, "partial")
        os.makedirs(self.folder, exist_ok=True)
        digest = hashlib.sha256(json.dumps(arguments, sort_keys=True).encode()).hexdigest()
        marker = os.path.join(self.folder, "arguments.json")
        with interrupts.critical():
            self._start(out, marker, digest, arguments)

    def _start(self, out: str, marker: str, digest: str, arguments: dict) -> None:
        if os.path.exists(marker):
            with open(marker) as f:
                same = json.load(f).get("digest") == digest
            if not same:
                print(f"other arguments than {out}'s partial results: starting over.", flush=True)
                for name in os.listdir(self.folder):
                    os.remove(os.path.join(self.folder, name))
        with open(marker, "w") as f:
            json.dump({"digest": digest, **arguments}, f, indent=2, default=str)

    def path(self, label: str, index: int) -> str:
        return os.path.join(self.folder, f"{label.replace(' ', '_')}-{index:05d}.npz")

    def load(self, label: str, index: int):
        import numpy as np

        try:
            with np.load(self.path(label, index)) as data:
                return {k: data[k] for k in data.files}
        except (OSError, ValueError, EOFError):  # missing or cut short by a kill
            return None

    def save(self, label: str, index: int, values: dict) -> None:
        import numpy as np

        tmp = self.path(label, index) + ".tmp.npz"
        with interrupts.critical():  # a signal waits for the chunk to be whole
            np.savez(tmp, **values)
            os.replace(tmp, self.path(label, index))

    def done(self) -> int:
        return sum(n.endswith(".npz") and ".tmp." not in n for n in os.listdir(self.folder))


def _chunk(evaluator, params, prompts, ids, size, k, noise, with_kl, metadata=None) -> dict:
    """The results of prompts `ids` (one chunk): metric values (sample-major), each
    prompt's diversity, the KL of each sample, a video's temporal distance, and the grid's
    images among them. `metadata` (one per prompt, or None) reaches the rewards taking it."""
    import numpy as np

    from tree_grpo_jax.evaluation import diversity
    from tree_grpo_jax.run import eval_metrics

    n = len(prompts)
    # The last chunk is topped up to the others' size: one compiled sampler serves all.
    padded = np.resize(ids, min(size, n))
    rows = (np.arange(k)[:, None] * n + padded[None]).reshape(-1)  # sample-major
    # each of the chunk's own prompts with its k noises (rows j * len(padded) + p)
    groups = [p + len(padded) * np.arange(k) for p in range(len(ids))] if k > 1 else []
    chosen = rows % n
    measured = eval_metrics.measure(
        evaluator,
        params,
        [prompts[i] for i in chosen],
        noise[rows],
        groups,
        with_kl,
        None if metadata is None else [metadata[i] for i in chosen],
    )

    def per_prompt(values):  # [K * padded, ...] -> [chunk prompts, K, ...]
        return diversity.by_prompt(values, len(padded), k)[: len(ids)]

    def flat(values):  # sample-major rows of the chunk's own prompts
        return np.swapaxes(per_prompt(values), 0, 1).reshape(-1, *np.shape(values)[1:])

    done = {m: flat(v) for m, v in measured.metrics.items()}
    if measured.temporal_distance is not None:
        done[TEMPORAL] = flat(measured.temporal_distance)
    if measured.diversity is not None:
        done["diversity"] = measured.diversity
    if with_kl:
        done["kl"] = flat(measured.kl)
    shown = ids[ids < GRID_PROMPTS]
    if shown.size:
        images = per_prompt(measured.samples.all_images())[: shown.size]
        done["grid"] = np.swapaxes(images, 0, 1)  # [K, prompts shown, H, W, C]
    return done


def _evaluate_model(
    evaluator, params, label, prompts, k, size, chunks, with_kl, categories=(), metadata=None
):
    """Every chunk of `size` prompts for one model (chunks already saved are read back);
    the model's row and its grid images (None on the processes that do not write). With
    `categories` (one per prompt, None for none), the row's `by_category` has each reward's
    mean and std over each category's samples."""
    import numpy as np

    from tree_grpo_jax import sharding
    from tree_grpo_jax.run import eval_metrics

    n = len(prompts)
    noise = eval_metrics.eval_noise(evaluator.config.eval.seed, n * k, evaluator.model.sample_shape)
    count = -(-n // size)
    parts, order = [], []  # order: the prompt of each value, as the chunks list them
    for index in range(count):
        done = chunks.load(label, index) if chunks is not None else None
        ids = np.arange(index * size, min(n, (index + 1) * size))
        order.append(np.tile(ids, k))  # sample-major, as `_chunk` lists a chunk's values
        # the primary process's folder decides; every process samples the chunk together
        if sharding.agree(float(chunks is not None and done is None)) > 0:
            t0 = time.time()
            done = _chunk(evaluator, params, prompts, ids, size, k, noise, with_kl, metadata)
            if chunks is not None:
                chunks.save(label, index, done)
                print(
                    f"{label}: prompts {ids[0] + 1}-{ids[-1] + 1} of {n} ({index + 1}/{count} "
                    f"chunks) in {time.time() - t0:.1f}s",
                    flush=True,
                )
        parts.append(done)
    if chunks is None:
        return None, None
    row = {"label": label}
    video = evaluator.frame_embed is not None
    figures = [*(["diversity"] if k > 1 else []), *([TEMPORAL] if video else [])]
    for name in [*evaluator.rewards, *figures, *(["kl"] if with_kl else [])]:
        values = np.concatenate([p[name] for p in parts])
        row[name] = {"mean": float(values.mean()), "std": float(values.std())}
    if any(c is not None for c in categories):
        row["by_category"] = _by_category(
            parts, np.concatenate(order), categories, list(evaluator.rewards)
        )
    grid = np.concatenate([p["grid"] for p in parts if "grid" in p], axis=1)
    return row, grid


def _by_category(parts, order, categories, names) -> dict:
    """{category: {metric: {"mean", "std"}}} over the values of each category's prompts
    (`order`: each value's prompt), categories in their first prompt's order."""
    import numpy as np

    of_value = np.array([categories[i] for i in order], dtype=object)
    out = {}
    for category in dict.fromkeys(c for c in categories if c is not None):
        mask = of_value == category
        out[category] = {}
        for name in names:
            values = np.concatenate([p[name] for p in parts])[mask]
            out[category][name] = {"mean": float(values.mean()), "std": float(values.std())}
    return out


def _category_tables(rows: list[dict], names: list[str], counts: dict) -> str:
    """One markdown table per metric: a line per category (its prompt count, each model's
    mean ± std, and each checkpoint's difference from the base)."""

    def cell(v):
        return f"{v['mean']:.4g} ± {v['std']:.3g}"

    base, labels = rows[0], [r["label"] for r in rows]
    out = []
    for name in names:
        head = ["category", "prompts", *labels, *(f"{r} − {labels[0]}" for r in labels[1:])]
        lines = [
            f"{name} per category:",
            "",
            "| " + " | ".join(head) + " |",
            "|---" * len(head) + "|",
        ]
        for category, count in counts.items():
            values = [r["by_category"][category][name] for r in rows]
            diffs = [
                f"{v['mean'] - base['by_category'][category][name]['mean']:+.4g}"
                for v in values[1:]
            ]
            cells = [category, str(count), *map(cell, values), *diffs]
            lines.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)


def _table(rows: list[dict], columns: list[str]) -> str:
    def cell(v):
        return f"{v['mean']:.4g} ± {v['std']:.3g}" if v else "—"

    lines = ["| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [
        f"| {r['label']} | " + " | ".join(cell(r.get(m)) for m in columns) + " |" for r in rows
    ]
    base = rows[0]
    for r in rows[1:]:
        diffs = [
            f"{r[m]['mean'] - base[m]['mean']:+.4g}" if m in r and m in base else "—"
            for m in columns
        ]
        lines.append(f"| {r['label']} − {base['label']} | " + " | ".join(diffs) + " |")
    return "\n".join(lines) + "\n"


def _check_run_config(config, ckpt, workdir: str) -> None:
    """Refuses a --config given beside --workdir that is not the run's own (another model,
    method or setting that makes another run, as resuming refuses it)."""
    from tree_grpo_jax.run.loop import run_mismatch

    saved = ckpt.read_meta().get("fingerprint")
    if saved is None:
        return  # nothing recorded to check against: the run's config.json decides
    differs = run_mismatch(saved, config)
    if differs:
        raise BadInput(
            f"--config is not the config of the run in {workdir} ({differs}); leave --config "
            "out to evaluate the run with its own."
        )


def _checked_flags(config, workdir: str | None):
    """--samples_per_prompt, --prompts_per_chunk, the metrics' names and the prompts
    (--prompts' set, else the run's eval prompts, with their categories), each checked."""
    from tree_grpo_jax.run.prompts import config_prompt_set, load_prompt_set, prompt_settings

    k, size = SAMPLES.value, CHUNK.value
    if NORMALISED.value and workdir is None:
        raise BadInput(
            "--normalised compares a checkpoint with the base model; give --workdir=<a "
            "training run>."
        )
    if k < 1:
        raise BadInput(f"--samples_per_prompt must be at least 1, got {k}.")
    if size < 1:
        raise BadInput(f"--prompts_per_chunk must be at least 1, got {size}.")
    names = _metric_names(config, METRICS.value)
    if PROMPTS.value:
        try:
            prompts = load_prompt_set(PROMPTS.value, *prompt_settings(config))
        except OSError as e:  # a name too long for the file system, a folder that refuses
            raise BadInput(
                f"--prompts {echo(PROMPTS.value)} cannot be read ({e.strerror or reason(e)})."
            ) from None
        except ValueError as e:  # the loader's sentence may name the config's field
            line = common.typed_flags(first_line(e), {"prompts.source": "--prompts"})
            raise BadInput(line) from None
    else:  # as the run's evaluation lists them (run/build.py)
        prompts = config_prompt_set(config, eval_set=True).cycled(config.prompts.eval_count)
    return k, size, names, prompts


def _open_run(config, workdir: str | None, given_config: bool):
    """The run's checkpoints, opened read-only, and --step (None: the newest readable);
    (None, None) without a run. A missing checkpoint or another run's config is refused."""
    from tree_grpo_jax.run import loop as train
    from tree_grpo_jax.run.checkpoint import Checkpointer

    if workdir is None:
        return None, None
    ckpt = Checkpointer(train.checkpoint_dir(config, workdir), read_only=True)
    steps = ckpt.all_steps()
    if not steps:
        raise BadInput(f"there is no checkpoint in {ckpt.directory}.")
    # --step pins one; without it the newest readable is restored (a damaged newest one
    # passed over with a warning, as training does).
    step = STEP.value
    if step is not None and step not in steps:
        raise BadInput(f"there is no checkpoint {step} in {ckpt.directory}; it holds {steps}.")
    if given_config:
        _check_run_config(config, ckpt, workdir)
    return ckpt, step


def _evaluation_config(config, k: int, names: list[str], with_kl: bool, chunk: int):
    """The run's config as the evaluation samples: `k` noises a prompt, `names` scored, the
    KL with a checkpoint, and nothing that stops or prints progress. Its eval set is one
    `chunk` of prompts, what one sampling holds: the checks of its size (`typed`) are this
    command's. With --prompts, the run's own prompt files need not be at hand."""
    config = config.copy_and_resolve_references()
    if PROMPTS.value:
        config.prompts.source, config.prompts.eval_source = PROMPTS.value, ""
    config.prompts.eval_count = chunk
    config.eval.samples_per_prompt = k
    config.eval.extra_rewards = tuple(names)
    config.eval.kl = with_kl
    if "guard" in config.eval:
        config.eval.guard.min_diversity_fraction = 0.0
        config.eval.guard.held_out_drop = 0.0
    config.log.progress = False
    return config


def _models(trainer, state, ckpt, step) -> tuple[list[tuple[str, object]], int | None]:
    """("base", its params) and, with a run, ("step N", the checkpoint's params), with the
    step restored (`step`, or the newest readable one when None)."""
    from tree_grpo_jax.run import loop as train

    models = [("base", state.params)]
    if ckpt is not None:
        train.check_base_weights(trainer, ckpt.read_meta(), ckpt.directory)
        restored, _, step = ckpt.restore(state, step)
        models.append((f"step {step}", restored.params))
        ckpt.close()
    return models, step


def _start_chunks(out: str, arguments: dict) -> _Chunks:
    """`out`'s saved chunks for `arguments`; a stop from now on says how to continue."""
    chunks = _Chunks(out, arguments)
    again = " ".join(["python -m tree_grpo_jax.evaluate", *map(shlex.quote, sys.argv[1:])])

    def line(name: str) -> str:
        done = chunks.done()
        if not done:  # nothing to continue from (a new folder goes: main's cleanup)
            return f"{name} stopped the evaluation before its first results; start it with: {again}"
        return (
            f"{name} stopped the evaluation; {done} chunk(s) of results are kept in "
            f"{chunks.folder}, and the same command continues from them: {again}"
        )

    interrupts.set_stop_line(line)
    return chunks


def _save_grid(out: str, row: dict, grid) -> None:
    """The model's picture grid (and a video's animation), named in its `row`."""
    from tree_grpo_jax.run import reporting
    from tree_grpo_jax.weights import staging

    name = f"grid_{row['label'].replace(' ', '_')}.png"
    path = os.path.join(out, name)
    with interrupts.critical(), staging.files_in_place(out) as stage:  # whole, or the old one
        cells = grid.reshape(-1, *grid.shape[2:])
        reporting.save_grid(os.path.join(stage, name), cells, columns=grid.shape[1])
    row["grid"] = path
    if reporting.is_video(grid[0]):
        row["animation"] = reporting.animation_path(path)


def evaluate(config, workdir: str | None, out: str, given_config: bool = False) -> dict:
    """Evaluates the base model and (with `workdir`) the run's checkpoint; writes `out`.
    `given_config`: `config` came from --config, not from the run's folder."""
    from tree_grpo_jax import sharding
    from tree_grpo_jax.run import out_of_memory
    from tree_grpo_jax.run.build import check_prompts, setup
    from tree_grpo_jax.run.input_images import check_prompt_images

    k, size, names, prompt_set = _checked_flags(config, workdir)
    ckpt, step = _open_run(config, workdir, given_config)
    check_out(out)

    chunk = min(size, len(prompt_set.prompts))
    config = _evaluation_config(config, k, names, workdir is not None, chunk)
    trainer, state = setup(config, out)
    prompts, categories = list(prompt_set.prompts), prompt_set.categories
    metadata = list(prompt_set.metadata) if any(prompt_set.metadata) else None
    # Before anything is written in `out`: a prompt the model cannot read is one sentence,
    # as are input images that no model or reward reads, or that cannot be read.
    check_prompts(trainer.model, (), prompts, "the model cannot read a prompt")
    evaluator = trainer.evaluator
    readers = [*evaluator.reward.rewards.values(), *evaluator.rewards.values()]
    where = "--prompts" if PROMPTS.value else "the eval prompts"
    check_prompt_images(trainer.model, readers, prompt_set.metadata, where)
    models, step = _models(trainer, state, ckpt, step)
    arguments = {
        "run": os.path.abspath(workdir) if workdir else None,
        "step": step,
        "model": [config.model.name, config.model.path],
        # the prompts and, where the file gives any, their metadata (a reward reads it)
        "prompts": hashlib.sha256(
            (
                "\n".join(prompts) + (json.dumps(metadata, sort_keys=True) if metadata else "")
            ).encode()
        ).hexdigest(),
        "samples_per_prompt": k,
        "metrics": names,
        "seed": config.eval.seed,
        "num_steps": config.eval.num_steps or config.sampling.num_steps,
        "prompts_per_chunk": size,
        "config": run_fingerprint.fingerprint(config),
    }
    primary = sharding.is_primary()
    chunks = _start_chunks(out, arguments) if primary else None
    rows = []
    lower = out_of_memory.lower_flags({"--prompts_per_chunk": chunk, "--samples_per_prompt": k})
    for label, params in models:
        with_kl = label != "base"
        with out_of_memory.said_as(
            lambda needed, label=label: (
                f"the device ran out of memory{needed} evaluating the {label} model, {chunk} "
                f"prompt(s) x {k} sample(s) at once; {lower}."
            )
        ):
            row, grid = _evaluate_model(
                trainer.evaluator,
                params,
                label,
                prompts,
                k,
                size,
                chunks,
                with_kl,
                categories,
                metadata,
            )
        rows.append(row)
        if primary:
            _save_grid(out, row, grid)
    result = {
        "source": arguments["run"] or config.model.path or config.model.name,
        "prompts": len(prompts),
        "samples_per_prompt": k,
        "metrics": names,
        "rows": rows,
    }
    if prompt_set.has_categories:
        counts = collections.Counter(c for c in categories if c is not None)
        result["categories"] = {c: counts[c] for c in dict.fromkeys(categories) if c in counts}
    if NORMALISED.value:
        result["normalised"] = normalised.scores(rows, names)
    if primary:
        _write_results(out, result, rows, names, prompts, k, arguments, config)
    return result


def _write_results(out, result, rows, names, prompts, k, arguments, config) -> None:
    """evaluation.json and evaluation.md, each in place only once whole (a rerun's replace
    the last ones only then)."""
    from tree_grpo_jax.weights import staging

    with interrupts.critical(), staging.files_in_place(out) as stage:
        with open(os.path.join(stage, "evaluation.json"), "w") as f:
            json.dump(result, f, indent=2)
        video = [TEMPORAL] if TEMPORAL in rows[0] else []
        columns = [*names, *(["diversity"] if k > 1 else []), *video]
        columns += ["kl"] if len(rows) > 1 else []
        head = (
            f"{len(prompts)} prompts x {k} samples, deterministic sampler "
            f"({arguments['num_steps']} steps), seed {config.eval.seed}; mean ± std over "
            "samples (diversity: over prompts)."
            + (f" {TEMPORAL}: mean distance between consecutive frames." if video else "")
            + "\n\n"
        )
        text = head + _table(rows, columns)
        if "categories" in result:
            text += "\n" + _category_tables(rows, names, result["categories"])
        if "normalised" in result:
            text += "\n" + normalised.table(result["normalised"], rows[0]["label"])
        with open(os.path.join(stage, "evaluation.md"), "w") as f:
            f.write(text)


def _remove_if_nothing_done(out: str) -> None:
    """A new output folder that holds no result (at most the record of the arguments of the
    chunks to come) goes."""
    marker = os.path.join(out, "partial", "arguments.json")
    for root, _, files in os.walk(out):
        if any(os.path.join(root, name) != marker for name in files):
            return
    shutil.rmtree(out, ignore_errors=True)


def main(argv=None) -> None:
    del argv
    common.quiet_orbax()
    from tree_grpo_jax.run import loop as train

    workdir = cli.WORKDIR.value
    config = cli.CONFIG.value
    try:
        if config is None:
            if workdir is None:
                raise BadInput("give --workdir=<a training run> or --config=<a config file>.")
            config = run_config(workdir)
        elif workdir is not None and not os.path.isdir(workdir):
            raise BadInput(f"there is no run folder {workdir}.")
        out = OUT.value or (os.path.join(workdir, "evaluation") if workdir else None)
        if out is None:
            raise BadInput("give --out=<folder> for the results of a model folder.")
        existed = os.path.exists(out)
        try:
            with interrupts.on_stop(lambda: existed or _remove_if_nothing_done(out)):
                result = evaluate(config, workdir, out, given_config=cli.CONFIG.value is not None)
        except BaseException:
            if not existed:
                _remove_if_nothing_done(out)
            raise
    except (BadInput, *train.BAD_INPUT) as e:
        typed = {**TYPED, **({"prompts.source": "--prompts"} if PROMPTS.value else {})}
        common.fail(common.typed_flags(first_line(e), typed), common.EXIT_BAD_INPUT)
    except (train.RewardError, train.DivergenceError, train.OutOfMemory) as e:
        common.fail(str(e), common.EXIT_FAILED)
    interrupts.set_stop_line(
        lambda name: f"{name} arrived after the evaluation was done; its results are in {out}."
    )
    from tree_grpo_jax import sharding

    if sharding.is_primary():
        print(
            f"evaluation of {workdir or result['source']} -> {os.path.join(out, 'evaluation.md')}"
        )
        with open(os.path.join(out, "evaluation.md")) as f:
            sys.stdout.write(f.read())


def run() -> None:
    common.starting("evaluate")
    main(cli.parse_flags(sys.argv, PARSER))
    interrupts.finish(0)


if __name__ == "__main__":
    run()
