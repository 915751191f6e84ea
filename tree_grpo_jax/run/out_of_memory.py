"""The device out of memory (XLA's RESOURCE_EXHAUSTED) in one sentence: which of the run's
programs ran out and when, as far as the error's traceback tells, and the settings that
make that program smaller, with values to try.

What the run holds then (its checkpoints, the command that resumes it) is the command line's
to say (cli/main.py); `OutOfMemory.resumable` gives it the settings a resume accepts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable

import jax

from tree_grpo_jax.models.base import remat_mode
from tree_grpo_jax.run.fingerprint import RESUME_MAY_CHANGE

# A LoRA rank above this is no low-rank adapter of any released denoiser layer.
LARGE_LORA_RANK = 512

_RUN = "tree_grpo_jax.run."
# (module, function) -> the program that runs there; the innermost one on the traceback wins
_PROGRAMS = {
    (_RUN + "trainer", "_rollout_program"): "rollout",
    (_RUN + "trainer", "update"): "train step",
    (_RUN + "evaluation", "sampler_program"): "evaluation",
    (_RUN + "scoring", "score"): "reward model",
    (_RUN + "scoring", "decode"): "decode",
}


class OutOfMemory(RuntimeError):
    """XLA could not allocate what a program needed; the message is one sentence naming the
    program, when, and the settings that lower its memory. `resumable`: those of them a
    resume accepts, {field: value}."""

    def __init__(self, message: str, resumable: dict | None = None):
        super().__init__(message)
        self.resumable = resumable or {}


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def needed(error: BaseException) -> str:
    """' (28.80GiB)': what XLA tried to allocate, when its message says; else ''."""
    found = re.search(r"allocat\w* ([0-9.]+ ?[KMGT]i?B)", str(error))
    return f" ({found.group(1)})" if found else ""


@contextlib.contextmanager
def said_as(sentence: Callable[[str], str]):
    """XLA's out-of-memory error inside the block as `OutOfMemory(sentence(needed(e)))`:
    a command's own sentence, naming its own flags."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if not is_out_of_memory(e):
            raise
        raise OutOfMemory(sentence(needed(e))) from None


def lower_flags(flags: dict[str, int]) -> str:
    """'lower --a (now 4) or --b (now 2)' for the flags above 1; when none is, that even the
    smallest batch does not fit."""
    above = [f"{flag} (now {value})" for flag, value in flags.items() if value > 1]
    if not above:
        return "even the smallest batch does not fit: use a device with more memory"
    return "lower " + " or ".join(above)


@dataclasses.dataclass(frozen=True)
class _Setting:
    field: str
    value: object
    why: str = ""  # what it does, when its name does not say

    def __str__(self) -> str:
        return f"{self.field}={self.value}" + (f" ({self.why})" if self.why else "")

    @property
    def resumable(self) -> bool:
        return any(
            self.field == k or (k.endswith(".") and self.field.startswith(k))
            for k in RESUME_MAY_CHANGE
        )


def _where(error: BaseException) -> tuple[str | None, str, object]:
    """(the program, when: 'of iteration 3', 'of the evaluation after iteration 2', 'while
    compiling it' or '', the trainer) as the traceback tells them; None and '' unknown."""
    program, when, trainer = None, "", None
    tb = error.__traceback__
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
        module, name = frame.f_globals.get("__name__", ""), frame.f_code.co_name
        local = frame.f_locals
        program = _PROGRAMS.get((module, name), program)
        if module == _RUN + "trainer" and trainer is None:
            trainer = local.get("self")
        if module == _RUN + "loop" and name == "_iteration":
            when = f"of iteration {local['iteration'] + 1}"
        elif module == _RUN + "loop" and name == "save_eval":
            when = f"of the evaluation after iteration {local['iteration']}"
        elif module == _RUN + "precompile" and name == "compile_one":
            program, when = local.get("name"), "while compiling it"
    if program == "evaluation" and when.startswith("of the evaluation"):
        when = when.replace("of the evaluation ", "", 1)
    return program, when, trainer


def _half(value: int) -> int:
    return max(1, int(value) // 2)


def _settings(program: str | None, evaluating: bool, config, trainer) -> list[_Setting]:
    """The settings that lower `program`'s memory, each with a value to try; those that
    already have their smallest value left out."""
    c = config
    full = not c.lora.rank
    rows = c.train.rows_per_minibatch
    accumulation = c.train.grad_accumulation
    batch = _Setting("prompts.batch_size", _half(c.prompts.batch_size), "prompts an iteration")
    eval_count = _Setting("prompts.eval_count", _half(c.prompts.eval_count))
    per_prompt = c.eval.samples_per_prompt
    eval_samples = _Setting("eval.samples_per_prompt", _half(per_prompt))
    devices = jax.device_count() // c.mesh.get("sequence", 1)  # what data x fsdp share
    # denoise_rows stays a multiple of the batch shards (`build.check_batches`)
    denoise_rows = c.sampling.denoise_rows or 0
    fewer = -(-8 // devices) * devices if not denoise_rows else _half(denoise_rows)
    fewer = max(devices, fewer // devices * devices)
    denoise = _Setting("sampling.denoise_rows", fewer, "rows through the denoiser at once")
    minibatch = _Setting(
        "train.rows_per_minibatch",
        _half(rows),
        f"with train.grad_accumulation={2 * accumulation} an update takes as many rows",
    )
    remat = _Setting("model.remat", True, "activations recomputed in the backward pass")
    bf16 = _Setting("model.compute_dtype", "bfloat16")
    moments = _Setting("train.optimizer_state_dtype", "bfloat16", "Adam's moments")
    lora = _Setting("lora.rank", 32, "LoRA: only low-rank factors trained, and in Adam")
    fsdp = _Setting("mesh.fsdp", devices, f"the weights sharded over the {devices} devices")
    chunk = _Setting("reward_options.chunk_size", _half(c.reward_options.chunk_size))
    on_host = getattr(getattr(trainer, "reward", None), "on_host", False)
    parts = _Setting(
        "reward_options.decode_chunks",
        2 * c.reward_options.decode_chunks,
        "the decode in parts, each scored as it comes",
    )

    keep = {
        "prompts.batch_size": c.prompts.batch_size > 1,
        "prompts.eval_count": c.prompts.eval_count > 1,
        "eval.samples_per_prompt": per_prompt > 1,
        "sampling.denoise_rows": denoise_rows != devices,
        "train.rows_per_minibatch": rows > 1,
        "model.remat": remat_mode(c.model.remat) == "none",
        "model.compute_dtype": c.model.compute_dtype == "float32",
        "train.optimizer_state_dtype": full and c.train.optimizer_state_dtype == "float32",
        "lora.rank": full,
        "mesh.fsdp": devices > 1 and c.mesh.fsdp == 1,
        "reward_options.chunk_size": c.reward_options.chunk_size > 1,
        "reward_options.decode_chunks": on_host,
    }
    samples = [eval_count, eval_samples] if evaluating else [batch]
    chosen = {
        "rollout": [batch, denoise, bf16, fsdp, lora],
        "train step": [minibatch, remat, moments, lora, bf16, fsdp],
        "evaluation": [eval_count, eval_samples, denoise, bf16, fsdp],
        "decode": [*samples, parts],
        "reward model": [chunk, *samples],
    }.get(program, [batch, minibatch, remat, denoise, bf16, lora, fsdp])
    return [s for s in chosen if keep[s.field]]


def out_of_memory(error: BaseException, config) -> OutOfMemory | None:
    """The one sentence of an XLA out-of-memory error (None: `error` is another)."""
    if not is_out_of_memory(error):
        return None
    program, when, trainer = _where(error)
    if program == "reward model" and getattr(getattr(trainer, "reward", None), "on_host", False):
        program = "decode"  # a host reward takes no device memory: its parts' decode does
    evaluating = "evaluation" in when or program == "evaluation"
    settings = _settings(program, evaluating, config, trainer)
    rank = int(config.lora.rank)
    likely = ""
    if rank > LARGE_LORA_RANK:
        likely = f"; lora.rank={rank} is the likely cause (LoRA ranks are 4-256): lower it"
    ran = f"in the {program}" if program else "in one of the run's programs"
    said = f"the device ran out of memory{needed(error)} {ran}{' ' + when if when else ''}"
    what = f"the {program}'s" if program else "the run's"
    lower = ", ".join(map(str, settings)) or "a smaller model or a larger device"
    return OutOfMemory(
        f"{said}{likely}; settings that lower {what} memory: {lower}",
        {s.field: s.value for s in settings if s.resumable},
    )
