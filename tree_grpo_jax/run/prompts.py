"""Prompt sets and a deterministic, resumable, shardable prompt stream.

`load_prompts("animals")` gives a built-in set; `load_prompts("my_prompts.txt")` reads one
prompt per line. `load_prompt_set(source, field, category_field)` also reads the papers'
prompt files with what each prompt carries: a `.jsonl` (one JSON object a line, GenEval's
`evaluation_metadata.jsonl`) or `.json` (a list of objects) with a prompt field, every other
field kept as that prompt's metadata, unchanged; a `.csv`, `.tsv` or `.parquet` table
(DrawBench, PartiPrompts, HPDv2) with a prompt column, every other column its metadata. A
category (a column or field: "category", "Category" or "tag" unless named) groups prompts
in `evaluate`'s report: one text or number, a list or object there is refused, as is a
column name (or an object's key) given twice, whose cells a row would silently lose.
`PromptIterator` walks the prompts in a fresh seeded shuffle every epoch, each batch
carrying its prompts' metadata (`PromptBatch`). Its only state is `position`, the number of
prompts drawn by all hosts together, so saving `state_dict()` and restoring it continues
the exact same stream.

A row of a JSON or table prompt file may name input images (`prompts.image_field`; an
"image" or "images" field unless named): a path, relative to the file's folder, or an
http(s) URL, or a list of them (`input_images.py`). They travel with the row's metadata
(`RowMetadata.input_images`, references whose pixels load when asked), so every batch, every
shard and every resumed stream carries them exactly as it carries the metadata.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tree_grpo_jax.errors import echo, reason
from tree_grpo_jax.models import registry as model_registry
from tree_grpo_jax.run import input_images as inputs
from tree_grpo_jax.run.input_images import RowMetadata, input_images_of

# Common animals, as bare names (DDPO's animal prompts are the names alone).
ANIMALS = (
    "cat", "dog", "horse", "cow", "pig", "sheep", "goat", "chicken", "duck", "goose",
    "rabbit", "mouse", "squirrel", "hedgehog", "fox", "wolf", "bear", "deer", "raccoon", "lion",
    "tiger", "leopard", "elephant", "giraffe", "zebra", "monkey", "gorilla", "kangaroo", "koala",
    "camel", "llama", "owl", "eagle", "parrot", "penguin", "flamingo", "frog", "turtle", "snake",
    "lizard", "crocodile", "fish", "shark", "dolphin", "whale", "octopus", "butterfly", "bee",
)  # fmt: skip
SIMPLE_ANIMALS = ("cat", "dog", "horse", "rabbit", "bird", "fish", "cow", "sheep")

PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "animals": ANIMALS,
    "simple_animals": SIMPLE_ANIMALS,
}


# The file kinds a prompt source may be, by suffix (no suffix: a text file, as before).
TEXT_SUFFIXES = (".txt", "")
SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".tsv", ".parquet")
# What an empty `prompts.field` / `prompts.category_field` looks for, in this order.
PROMPT_FIELDS = ("prompt", "Prompt", "prompts", "Prompts")
CATEGORY_FIELDS = ("category", "Category", "tag")


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Prompts with, in the same order, each one's metadata (the other fields of its row,
    unchanged; {} for a text file or a built-in set) and category (None without one)."""

    prompts: tuple[str, ...]
    metadata: tuple[dict, ...]
    categories: tuple[str | None, ...]

    @classmethod
    def plain(cls, prompts: Sequence[str]) -> PromptSet:
        n = len(prompts)
        return cls(tuple(prompts), tuple({} for _ in range(n)), (None,) * n)

    def __len__(self) -> int:
        return len(self.prompts)

    def cycled(self, count: int) -> PromptSet:
        """The first `count` rows, the set repeated as often as needed (the eval prompts)."""
        rows = [i % len(self) for i in range(count)]
        return PromptSet(
            tuple(self.prompts[i] for i in rows),
            tuple(self.metadata[i] for i in rows),
            tuple(self.categories[i] for i in rows),
        )

    @property
    def has_categories(self) -> bool:
        return any(c is not None for c in self.categories)

    @property
    def input_images(self) -> tuple[tuple, ...]:
        """Each row's input images (references), () for a row without any."""
        return tuple(input_images_of(m) for m in self.metadata)

    @property
    def has_input_images(self) -> bool:
        return any(self.input_images)


def prompt_sets() -> dict[str, tuple[str, ...]]:
    """Every built-in set: the ones above and those model families bring (the tiny
    model's "digits")."""
    sets = dict(PROMPT_SETS)
    for family in model_registry.families():
        sets.update(family.prompt_sets)
    return sets


def load_prompts(
    source: str, field: str = "", category_field: str = "", image_field: str = ""
) -> list[str]:
    """A built-in set by name, or a prompt file (see `load_prompt_set`): its prompts."""
    return list(load_prompt_set(source, field, category_field, image_field).prompts)


def prompt_settings(config) -> tuple[str, str, str]:
    """(prompts.field, prompts.category_field, prompts.image_field) of `config` (empty:
    found by name)."""
    return config.prompts.field, config.prompts.category_field, config.prompts.image_field


def config_prompt_set(config, eval_set: bool = False) -> PromptSet:
    """The run's training prompts (`prompts.source`) or, with `eval_set`, the set its eval
    prompts are drawn from (`prompts.eval_source`, else `prompts.source`)."""
    source = config.prompts.source
    if eval_set:
        source = config.prompts.eval_source or source
    return load_prompt_set(source, *prompt_settings(config))


def load_prompt_set(
    source: str, field: str = "", category_field: str = "", image_field: str = ""
) -> PromptSet:
    """A built-in set by name, or a prompt file: a text file with one prompt per line (blank
    lines skipped), a `.jsonl` / `.json` of objects or a `.csv` / `.tsv` / `.parquet` table.
    `field` names the prompt field or column, `category_field` the category and
    `image_field` the input images (empty: found among PROMPT_FIELDS, CATEGORY_FIELDS and
    `input_images.IMAGE_FIELDS`; "none" for the images: none read); all are read only from
    JSON and tables. Bad input is a ValueError of one sentence."""
    if field and field == category_field:
        raise ValueError(
            f"prompts.field and prompts.category_field both name {echo(field)}; a column is "
            "either the prompt or its category."
        )
    if image_field and image_field in (field, category_field):
        raise ValueError(
            f"prompts.image_field names {echo(image_field)} as prompts.field or "
            "prompts.category_field does; a column is the prompt, its category or its images."
        )
    named_images = image_field not in ("", inputs.NO_IMAGES)
    sets = prompt_sets()
    if source in sets:
        if named_images:
            raise ValueError(
                f"prompts.image_field is {echo(image_field)} but the prompt source "
                f"{echo(source)} is a built-in set, which names no images; give a prompt file."
            )
        return PromptSet.plain(sets[source])
    path = Path(os.path.expanduser(source))  # `~nosuchuser` stays as written
    try:
        is_file = path.is_file()
    except OSError as e:  # a name over 255 bytes, a folder that may not be looked into
        raise ValueError(
            f"prompt source {echo(source)} cannot be looked up as a file ({e.strerror or e}); "
            "give a built-in set or an existing prompt file."
        ) from None
    if not is_file:
        names = ", ".join(sorted(sets))
        raise ValueError(
            f"prompt source {echo(source)} is neither a built-in set ({names}) nor an existing "
            "text file with one prompt per line (or a .jsonl, .json, .csv, .tsv or .parquet "
            "prompt file)."
        )
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES and suffix not in TEXT_SUFFIXES:
        raise ValueError(
            f"prompt file {path} has the unknown extension {echo(path.suffix)}; a prompt file "
            "is one of " + ", ".join(SUFFIXES) + "."
        )
    if suffix == ".parquet":
        records = _parquet_rows(path)
        return _from_records(path, records, field, category_field, "row", image_field)
    text = _read_text(path)
    if suffix in TEXT_SUFFIXES:
        if named_images:
            raise ValueError(
                f"prompts.image_field is {echo(image_field)} but prompt file {path} is a text "
                "file, which names no images; write a .jsonl or table with an image column."
            )
        prompts = [p for p in (line.strip() for line in text.splitlines()) if p]
        if not prompts:
            raise ValueError(f"prompt file {path} has no prompts; write one prompt per line.")
        return PromptSet.plain(prompts)
    if not text.strip():
        raise ValueError(f"prompt file {path} has no prompts; it is empty.")
    if suffix == ".jsonl":
        rows = _jsonl_rows(path, text)
        return _from_records(path, rows, field, category_field, "line", image_field)
    if suffix == ".json":
        rows = _json_rows(path, text)
        return _from_records(path, rows, field, category_field, "entry", image_field)
    delimiter = "\t" if suffix == ".tsv" else ","
    return _from_table(path, text, delimiter, field, category_field, image_field)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a spreadsheet's byte-order mark
    except UnicodeDecodeError as e:
        bad = e.object[e.start : e.start + 1].hex()
        raise ValueError(
            f"prompt file {path} is not UTF-8 text (byte 0x{bad} at offset {e.start} cannot "
            "be decoded); save it as UTF-8."
        ) from None
    except OSError as e:
        raise ValueError(f"prompt file {path} cannot be read: {e.strerror or e}.") from None


class _KeyTwice(Exception):
    """An object of a JSON prompt file names a key twice (json keeps the last silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _KeyTwice(key)
        seen[key] = value
    return seen


def _key_twice(where: str, key: str) -> ValueError:
    return ValueError(
        f"{where} has the key {echo(key)} twice in one object; a row keeps only one of them: "
        "rename or remove the other."
    )


def _jsonl_rows(path: Path, text: str) -> list[tuple[int, Any]]:
    """(line number, object) of every non-blank line."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line, object_pairs_hook=_unique_keys)))
        except json.JSONDecodeError as e:
            raise ValueError(
                f"line {number} of prompt file {path} is not valid JSON ({e.msg} at column "
                f"{e.colno}); write one JSON object per line."
            ) from None
        except _KeyTwice as e:
            raise _key_twice(f"line {number} of prompt file {path}", e.args[0]) from None
    return rows


def _json_rows(path: Path, text: str) -> list[tuple[int, Any]]:
    """(entry number from 1, object) of the file's list."""
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"prompt file {path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})."
        ) from None
    except _KeyTwice as e:
        raise _key_twice(f"prompt file {path}", e.args[0]) from None
    if not isinstance(data, list):
        raise ValueError(
            f"prompt file {path} holds a JSON {type(data).__name__}, not a list of objects "
            'with a prompt field, e.g. [{"prompt": "a red cube"}].'
        )
    return list(enumerate(data, 1))


def _parquet_rows(path: Path) -> list[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"prompt file {path} is a Parquet file, which needs pyarrow: "
            "pip install 'tree_grpo_jax[parquet]' (or pip install pyarrow)."
        ) from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's errors have no common base of their own
        raise ValueError(f"prompt file {path} cannot be read as Parquet ({reason(e)}).") from None
    return list(enumerate(rows, 1))


def _found(path: Path, have: Sequence[str], named: str, candidates, setting: str, kind: str):
    """The field or column to read: `named` when set (which must be in `have`), else the one
    of `candidates` in `have` (None when none is; several is an error)."""
    if named:
        return named if named in have else False
    present = [c for c in candidates if c in have]
    if len(present) > 1:
        raise ValueError(
            f"prompt file {path} has several {kind} {', '.join(map(repr, present))}; name "
            f"the one to read with --config.{setting}=<name>."
        )
    return present[0] if present else None


def _listed(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names) or "none"


def _prompt_and_category(path, have, named, noun: str, where=("", "")) -> tuple[str, str | None]:
    """The prompt's and the category's field or column (`noun`): `named` (prompts.field,
    prompts.category_field) when set, else found among PROMPT_FIELDS and CATEGORY_FIELDS in
    `have` (the names to look for the prompt in, and the category in); `where` places the
    message (the row it names, "in any row"). The category's is None when there is none."""
    key = _found(path, have[0], named[0], PROMPT_FIELDS, "prompts.field", f"prompt {noun}s")
    if not key:
        wanted = repr(named[0]) if named[0] else " or ".join(map(repr, PROMPT_FIELDS))
        raise ValueError(
            f"{where[0]}prompt file {path} has no {wanted} {noun} (its {noun}s: "
            f"{_listed(have[0])}); name the prompt {noun} with --config.prompts.field."
        )
    cat = _found(
        path, have[1], named[1], CATEGORY_FIELDS, "prompts.category_field", f"category {noun}s"
    )
    if cat is False:
        raise ValueError(
            f"prompt file {path} has no {named[1]!r} {noun}{where[1]} (its {noun}s: "
            f"{_listed(have[1])}); fix prompts.category_field."
        )
    return key, cat


def _from_records(path, records, field, category_field, unit, image_field="") -> PromptSet:
    """The prompt set of JSON or Parquet rows: (number, object) pairs, `unit` naming a
    number in a message ("line", "entry", "row"); `image_field` as `load_prompt_set`'s."""
    if not records:
        raise ValueError(f"prompt file {path} has no prompts; it holds no {unit} at all.")
    for number, row in records:
        if not isinstance(row, dict):
            raise ValueError(
                f"{unit} {number} of prompt file {path} is a JSON {type(row).__name__}, not an "
                "object with a prompt field."
            )
    number, first = records[0]
    every = list(dict.fromkeys(k for _, row in records for k in row))
    key, cat = _prompt_and_category(
        path,
        (list(first), every),
        (field, category_field),
        "field",
        (f"{unit} {number} of ", f" in any {unit}"),
    )
    images = inputs.image_field(path, every, image_field)
    if images in (key, cat):  # found by name beside a prompt or category of the same name
        images = None
    prompts, metadata, categories = [], [], []
    for number, row in records:
        if key not in row:
            raise ValueError(
                f"{unit} {number} of prompt file {path} has no {key!r} field (its fields: "
                f"{_listed(list(row))}); every {unit} needs its prompt."
            )
        prompt = row[key]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(
                f"{unit} {number} of prompt file {path} has no prompt: its {key!r} is "
                f"{json.dumps(prompt, default=str)}, not a non-empty text."
            )
        prompts.append(prompt.strip())
        fields = {k: v for k, v in row.items() if k != key}
        refs = ()
        if images:
            where = f"{unit} {number} of prompt file {path}"
            refs = inputs.references(row.get(images), path.parent, where, images)
        metadata.append(RowMetadata(fields, refs) if images else fields)
        value = row.get(cat) if cat else None
        if isinstance(value, (list, tuple, dict)):  # its text would group nothing usefully
            raise ValueError(
                f"{unit} {number} of prompt file {path} has a {type(value).__name__} as its "
                f"category {cat!r} ({echo(json.dumps(value, default=str))}); a category is one "
                "text or number: write one, or name another field with "
                "--config.prompts.category_field."
            )
        categories.append(None if value is None or value == "" else str(value))
    return PromptSet(tuple(prompts), tuple(metadata), tuple(categories))


def _from_table(path, text, delimiter, field, category_field, image_field="") -> PromptSet:
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        header = next(reader, None)
        body = list(reader)
    except csv.Error as e:
        raise ValueError(f"prompt file {path} is not a readable table: {e}.") from None
    if header is None or not any(h.strip() for h in header):
        raise ValueError(f"prompt file {path} has no prompts; it is empty.")
    header = [h.strip() for h in header]
    _check_unique_columns(path, header)
    key, cat = _prompt_and_category(path, (header, header), (field, category_field), "column")
    records = []
    for number, cells in enumerate(body, 2):  # the header is row 1
        if not any(c.strip() for c in cells):
            continue  # a blank line
        if len(cells) > len(header):
            raise ValueError(
                f"row {number} of prompt file {path} has {len(cells)} cells but the header "
                f"names {len(header)} columns."
            )
        records.append((number, dict(zip(header, cells))))  # short rows: their cells only
    if not records:
        raise ValueError(f"prompt file {path} has no prompts; it has a header and no rows.")
    return _from_records(path, records, key, cat or "", "row", image_field)


def _check_unique_columns(path, header: list[str]) -> None:
    """A name given to two columns would keep only the last one's cells in each row. Columns
    without a name (a spreadsheet's trailing delimiters) are left alone."""
    twice = next((h for i, h in enumerate(header) if h and h in header[:i]), None)
    if twice is None:
        return
    numbers = [str(i) for i, h in enumerate(header, 1) if h == twice]
    listed = " and ".join([", ".join(numbers[:-1]), numbers[-1]])
    raise ValueError(
        f"prompt file {path} has {len(numbers)} columns named {echo(twice)} (columns "
        f"{listed}); a row keeps only one of them: rename all but one."
    )


class PromptBatch(list):
    """A batch of prompts (a list of str) with `metadata`, each prompt's dict in order, and
    `input_images`, each prompt's input images (references; () for none)."""

    def __init__(self, prompts: Sequence[str], metadata: Sequence[dict]):
        super().__init__(prompts)
        self.metadata = list(metadata)

    @property
    def input_images(self) -> list[tuple]:
        return [input_images_of(m) for m in self.metadata]


def leaf_metadata(batch: Sequence[str], rows: slice = slice(None), repeat: int = 1) -> list:
    """The metadata of `batch`'s prompts `rows`, each repeated `repeat` times (one per leaf of
    a prompt's tree): in the order of the prompts a reward receives with the images. A batch
    without metadata (a plain list) gives {} for each."""
    metadata = getattr(batch, "metadata", None)
    if metadata is None:
        metadata = [{} for _ in batch]
    return [m for m in metadata[rows] for _ in range(repeat)]


class PromptIterator:
    """Batches of prompts, reshuffled every epoch with `seed`, exactly resumable.

    The stream is global: every `next_batch` advances `position` by
    `batch_size * num_shards`, and shard `shard_index` takes its own contiguous
    `batch_size` slice of that global batch. Hosts with the same seed and position therefore
    draw disjoint prompts within a global batch (and within an epoch when the number of
    prompts is a multiple of the global batch).
    """

    def __init__(
        self,
        prompts: Sequence[str],
        batch_size: int,
        seed: int,
        position: int = 0,
        *,
        shard_index: int = 0,
        num_shards: int = 1,
        metadata: Sequence[dict] | None = None,
    ):
        if not prompts:
            raise ValueError("PromptIterator needs at least one prompt.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ValueError(
                f"shard_index must be in [0, num_shards), got {shard_index} of {num_shards}."
            )
        if position < 0:
            raise ValueError(f"position must be non-negative, got {position}.")
        if metadata is not None and len(metadata) != len(prompts):
            raise ValueError(f"{len(metadata)} metadata for {len(prompts)} prompts.")
        self.prompts = list(prompts)
        self.metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.position = int(position)
        self.shard_index = int(shard_index)
        self.num_shards = int(num_shards)
        self._perms: dict[int, np.ndarray] = {}

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.num_shards

    @property
    def epoch(self) -> int:
        return self.position // len(self.prompts)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:  # a batch spans at most a few epochs
                self._perms.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(len(self.prompts))
        return self._perms[epoch]

    def _index_at(self, index: int) -> int:
        epoch, offset = divmod(index, len(self.prompts))
        return int(self._permutation(epoch)[offset])

    def _batch(self, start: int, size: int) -> PromptBatch:
        ids = [self._index_at(start + i) for i in range(size)]
        self.position += self.global_batch_size
        return PromptBatch([self.prompts[i] for i in ids], [self.metadata[i] for i in ids])

    def next_batch(self) -> PromptBatch:
        """This shard's prompts of the next draw, their metadata in `.metadata`."""
        return self._batch(self.position + self.shard_index * self.batch_size, self.batch_size)

    def next_global_batch(self) -> PromptBatch:
        """Every shard's batch of this draw, in shard order: shard i's `next_batch` is rows
        i * batch_size .. (i + 1) * batch_size - 1 of it. Advances like `next_batch`."""
        return self._batch(self.position, self.global_batch_size)

    def state_dict(self) -> dict[str, int]:
        """Small, all ints: what a checkpoint stores."""
        return {"position": self.position, "seed": self.seed, "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        """Continues a saved stream; the seed and the prompt count must be the same."""
        for key, mine in (("seed", self.seed), ("num_prompts", len(self.prompts))):
            if int(state[key]) != mine:
                raise ValueError(
                    f"the saved prompt stream has {key}={int(state[key])} but this one has "
                    f"{key}={mine}; resume with the same prompts and seed."
                )
        self.position = int(state["position"])


def prompt_iterator(config) -> PromptIterator:
    """The run's training prompt stream, this process's shard of it."""
    prompts = config_prompt_set(config)
    return PromptIterator(
        prompts.prompts,
        config.prompts.batch_size,
        seed=config.seed,
        shard_index=jax.process_index(),
        num_shards=jax.process_count(),
        metadata=prompts.metadata,
    )
