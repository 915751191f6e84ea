"""What a run depends on beyond its config: its training prompts and the files of every
frozen part it reads.

A run's checkpoints record `of_run(config)`, and a resume compares it with what the config
points at now (`mismatch`), before any model loads: the training prompts in order, with
their metadata when their file gives any (a prompt file edited in place would continue the
prompt stream over another list), and the files of
each component folder of `model.path` the run does not train (text encoders, tokenizers,
VAE, scheduler; the denoiser too under LoRA, where it is the frozen base) and of every
reward model folder the run uses. Hub ids are recorded as such and not checked. The eval
prompts may change on resume, so they are not part of it.

File digests (sha256) are remembered in a small JSON file under the user's cache folder,
keyed by path, size and modification time, so a resume hashes only what changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
import time
from collections.abc import Callable, Mapping

from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.rewards import registry as reward_registry
from tree_grpo_jax.run.prompts import config_prompt_set

ENV_CACHE = "TREE_GRPO_JAX_DIGEST_CACHE"  # overrides the digest cache's file
ANNOUNCE_BYTES = 1 << 30  # hashing more than this for the first time prints a line
# A file modified this recently could change again within the same mtime tick (coarse
# file-system clocks), so its digest is not remembered.
RACY_NS = 2_000_000_000
MODEL = "model.path"
NOT_LOCAL = "not a local folder"
SINCE = "since the run's checkpoints were saved"


def default_cache_path() -> pathlib.Path:
    """`$TREE_GRPO_JAX_DIGEST_CACHE`, else `$XDG_CACHE_HOME/tree_grpo_jax/file_digests.json`,
    else `~/.cache/tree_grpo_jax/file_digests.json` (compile_cache.py's convention)."""
    if os.environ.get(ENV_CACHE):
        return pathlib.Path(os.environ[ENV_CACHE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base).expanduser() / "tree_grpo_jax" / "file_digests.json"


def _hash_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class FileDigests:
    """sha256 of files, remembered on disk by (real path, size, mtime_ns)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = pathlib.Path(path) if path else default_cache_path()
        self._entries: dict[str, list] = {}
        self._changed = False
        try:
            entries = json.loads(self.path.read_text()).get("files", {})
            if isinstance(entries, dict):
                self._entries = entries
        except (OSError, ValueError, AttributeError):  # none yet, or unreadable: start empty
            pass

    @staticmethod
    def _key(path: str) -> tuple[str, os.stat_result]:
        real = os.path.realpath(path)
        return real, os.stat(real)

    def known(self, path: str) -> str | None:
        """The remembered digest of `path` as it is now, or None."""
        try:
            real, st = self._key(path)
        except OSError:
            return None
        entry = self._entries.get(real)
        if entry and entry[:2] == [st.st_size, st.st_mtime_ns]:
            return entry[2]
        return None

    def digest(self, path: str) -> str:
        known = self.known(path)
        if known is not None:
            return known
        real, st = self._key(path)
        digest = _hash_file(real)
        if time.time_ns() - st.st_mtime_ns > RACY_NS:
            self._entries[real] = [st.st_size, st.st_mtime_ns, digest]
            self._changed = True
        return digest

    def save(self) -> None:
        """Writes what was learned; a cache that cannot be written only costs a re-hash."""
        if not self._changed:
            return
        kept = {p: e for p, e in self._entries.items() if os.path.exists(p)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"files": kept}, f)
            os.replace(temp, self.path)  # whole or not at all, whoever else writes it
            self._changed = False
        except OSError:
            pass


def list_files(folder: str | os.PathLike) -> dict[str, str]:
    """relative path ("sub/name", sorted) -> absolute path of every file below `folder`;
    hidden entries (".cache/", ".git/") are left out: downloads and tools keep their own
    bookkeeping there."""
    root = os.path.abspath(folder)
    found = {}
    for here, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if not name.startswith("."):
                path = os.path.join(here, name)
                found[os.path.relpath(path, root).replace(os.sep, "/")] = path
    return dict(sorted(found.items()))


def folder_digest(files: Mapping[str, str]) -> str:
    """One digest of {relative path: file digest}, whatever order they were listed in."""
    text = json.dumps(sorted(files.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def prompts_digest(prompts: list[str], metadata: list[dict] | None = None) -> str:
    """The prompts' digest; with any prompt's metadata (a prompt file's other fields), of
    the prompts and their metadata together (a text file's digest is the prompts' alone)."""
    if metadata and any(metadata):
        text = json.dumps([list(prompts), list(metadata)], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()
    return hashlib.sha256(json.dumps(list(prompts)).encode()).hexdigest()


def _frozen_folders(config) -> dict[str, str]:
    """part name -> the folder (or hub id) as configured, for every frozen part the run
    reads from a folder."""
    parts = {}
    family = model_registry.family_of(config.model.name)
    path = config.model.path
    if family.needs_path and path:
        root = pathlib.Path(os.path.expanduser(path))
        if not os.path.isdir(root):  # not a folder, or not one to look at: the loader says
            parts[MODEL] = path
        else:
            # full fine-tuning replaces the denoiser: its base files are not what it resumes
            trained = family.export.component if family.export and config.lora.rank == 0 else None
            for sub in sorted(root.iterdir()):
                if sub.is_dir() and not sub.name.startswith(".") and sub.name != trained:
                    parts[f"{MODEL}/{sub.name}"] = str(sub)
    names = [*reward_registry.parse_rewards(config.rewards), *config.eval.extra_rewards]
    for name in dict.fromkeys(names):
        if reward_registry.needs_weights(name):
            parts[f"reward_models.{name}"] = config.reward_models.get(name) or ""
    return parts


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _digest_or_why(digests: FileDigests, path: str) -> str:
    """A file that cannot be read (a dangling link of an unfinished download) is recorded as
    such: the loader says what is wrong if the run needs it."""
    try:
        return digests.digest(path)
    except OSError as e:
        return f"unreadable ({e.strerror or type(e).__name__})"


_remembered: tuple | None = None  # (config, its identity) of the last `measure`


def measure(config, say: Callable[[str], None] = print, digests: FileDigests | None = None) -> dict:
    """The run's identity as `config` points at it now (see the module's doc), remembered for
    `of_run(config)`; `say` gets one line when more than a gigabyte is hashed."""
    global _remembered
    digests = digests or FileDigests()
    prompts = config_prompt_set(config)
    listed, skipped = {}, {}
    for part, where in _frozen_folders(config).items():
        if where and os.path.isdir(os.path.expanduser(where)):
            listed[part] = (os.path.abspath(os.path.expanduser(where)), list_files(where))
        else:
            skipped[part] = where
    unknown = {
        part: sum(_size(p) for p in files.values() if digests.known(p) is None)
        for part, (_, files) in listed.items()
    }
    if sum(unknown.values()) > ANNOUNCE_BYTES:
        names = ", ".join(_shown(p) for p, size in unknown.items() if size)
        say(f"hashing the files of {names} ({sum(unknown.values()) / 1e9:.1f} GB, once)...")
    records = {part: {"folder": where, "skipped": NOT_LOCAL} for part, where in skipped.items()}
    for part, (folder, files) in listed.items():
        file_digests = {rel: _digest_or_why(digests, path) for rel, path in files.items()}
        records[part] = {
            "folder": folder,
            "sha256": folder_digest(file_digests),
            "files": file_digests,
        }
    digests.save()
    identity = {
        "prompts": {
            "source": config.prompts.source,
            "count": len(prompts),
            "sha256": prompts_digest(prompts.prompts, prompts.metadata),
        },
        "folders": dict(sorted(records.items())),
    }
    _remembered = (config, identity)
    return identity


def of_run(config) -> dict:
    """The identity `measure` took of this config (at the run's start), else a new one."""
    if _remembered is not None and _remembered[0] is config:
        return _remembered[1]
    return measure(config, say=lambda line: None)


def _shown(part: str) -> str:
    """ "model.path/text_encoder" -> "model.path's text_encoder"."""
    if part.startswith(f"{MODEL}/"):
        return f"{MODEL}'s {part[len(MODEL) + 1 :]}"
    return part


def _changes(saved: Mapping[str, str], now: Mapping[str, str], prefix: str) -> str:
    differ = [f"{prefix}{k}" for k in saved if k in now and saved[k] != now[k]]
    differ += [f"{prefix}{k} new" for k in now if k not in saved]
    differ += [f"{prefix}{k} gone" for k in saved if k not in now]
    more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
    return ", ".join(differ[:3]) + more


def mismatch(saved: dict | None, current: dict) -> str | None:
    """One sentence naming what differs between a recorded identity and the current one;
    None when they agree or `saved` is None (checkpoints from before it was recorded).
    Parts recorded as hub ids on either side are not compared, nor a reward that only one
    side uses (eval.extra_rewards may change on resume)."""
    if not saved:
        return None
    was, now = saved.get("prompts", {}), current["prompts"]
    if was and was["sha256"] != now["sha256"]:
        how = (
            "same count, other content or order"
            if was["count"] == now["count"]
            else f"{was['count']} prompts then, {now['count']} now"
        )
        return (
            f"the prompts in prompts.source {now['source']!r} changed {SINCE} ({how}); resume "
            "with the prompts it was trained on or choose another --workdir."
        )
    was, now = saved.get("folders", {}), current["folders"]
    # Which component folders model.path holds (when it is a local folder on both sides).
    if MODEL not in was and MODEL not in now:
        one_side = sorted(p for p in set(was) ^ set(now) if p.startswith(f"{MODEL}/"))
        if one_side:
            root = os.path.dirname((now.get(one_side[0]) or was[one_side[0]])["folder"])
            listed = [f"{p[len(MODEL) + 1 :]}/ {'new' if p in now else 'gone'}" for p in one_side]
            return (
                f"the folders of {MODEL} {root!r} changed {SINCE} ({', '.join(listed)}); "
                "resume with the files it was trained on or choose another --workdir."
            )
    for part in sorted(set(was) & set(now)):
        before, after = was[part], now[part]
        if "sha256" not in before or "sha256" not in after or before["sha256"] == after["sha256"]:
            continue
        prefix = part[len(MODEL) + 1 :] + "/" if part.startswith(f"{MODEL}/") else ""
        changes = _changes(before["files"], after["files"], prefix)
        return (
            f"the files of {_shown(part)} {after['folder']!r} changed {SINCE} ({changes}); "
            "resume with the files it was trained on or choose another --workdir."
        )
    return None


def other_base(
    saved: dict | None, model_path: str, digests: FileDigests | None = None
) -> str | None:
    """What differs between the `model.path` components a run recorded (its checkpoint's
    identity) and those of `model_path` now: one clause naming the first component and its
    changed files, or None when they agree (or nothing was recorded, or no local folder)."""
    recorded = {
        part[len(MODEL) + 1 :]: record
        for part, record in ((saved or {}).get("folders") or {}).items()
        if part.startswith(f"{MODEL}/") and "sha256" in record
    }
    root = pathlib.Path(model_path).expanduser()
    if not recorded or not root.is_dir():
        return None
    digests = digests or FileDigests()
    try:
        for name, record in sorted(recorded.items()):
            folder = root / name
            if not folder.is_dir():
                return f"it has no {name}/, which the run was trained with"
            files = {rel: _digest_or_why(digests, path) for rel, path in list_files(folder).items()}
            if folder_digest(files) != record["sha256"]:
                return f"its {name}/ differs ({_changes(record['files'], files, name + '/')})"
    finally:
        digests.save()
    return None
