"""Reference images inside the conditioning array, for the editing families (FLUX.1-Kontext,
FLUX.2).

The package hands the denoiser one array per prompt, [L, D], of one length for every prompt.
An editing model's array is the prompt's text rows followed by one row per reference token:
its C packed latent channels, then its position ids (3 for FLUX.1, 4 for FLUX.2), then zeros
(D >= C + ids; a family whose text rows are narrower pads them). The number of reference
rows is fixed by the model's settings (`reference_images` square images of
`reference_resolution` pixels each), so every prompt's array has the same length and the
denoiser splits it at the text's row count, a constant of the model.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

KEPT_REFERENCES = 64  # prompts' reference rows kept: a batch's few distinct rows re-encode once


def reference_rows(tokens: np.ndarray, ids: np.ndarray, width: int) -> np.ndarray:
    """Reference tokens [M, C] and their ids [M, A] as M conditioning rows [M, width]."""
    count, channels = tokens.shape
    id_columns = ids.shape[1]
    if channels + id_columns > width:
        raise ValueError(
            f"the conditioning is {width} wide, too narrow for {channels} reference channels "
            f"and {id_columns} ids."
        )
    rows = np.zeros((count, width), np.float32)
    rows[:, :channels], rows[:, channels : channels + id_columns] = tokens, ids
    return rows


def split_references(cond: jax.Array, text_rows: int, channels: int, id_columns: int):
    """cond [B, text_rows + M, D] -> (text [B, text_rows, D], (tokens [B, M, channels],
    ids [B, M, id_columns] float32)), the inverse of appending `reference_rows`."""
    rows = cond[:, text_rows:]
    ids = rows[..., channels : channels + id_columns].astype(jnp.float32)
    return cond[:, :text_rows], (rows[..., :channels], ids)


@dataclasses.dataclass(eq=False)
class EditConditioning:
    """An editing model's `encode_prompts(prompts, input_images=None)`: each prompt's text
    rows (`text.conditioning(prompts)`, [P, T, width]), then the `reference_rows` of its
    `count` input images (exactly that many, each `side` x `side` pixels), which
    `references(images)` encodes as (tokens, ids). Without `input_images` (a run's checks,
    the empty prompt of guidance) the reference rows are zeros. A few recent images' rows
    are kept. `settings` names the family's settings section in the sentences."""

    text: object
    references: object  # (images) -> (tokens [M, C], ids [M, A]); `.multiple` pixels a token
    count: int
    side: int
    width: int
    settings: str
    kept: dict = dataclasses.field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.count * (self.side // self.references.multiple) ** 2

    def image_rows(self, images) -> np.ndarray:
        if len(images) != self.count:
            raise ValueError(
                f"the model edits from {self.count} input image(s) per prompt "
                f"({self.settings}.reference_images), but a prompt names {len(images)}."
            )
        images = [np.asarray(image, np.uint8) for image in images]
        for image in images:
            if image.shape[:2] != (self.side, self.side):
                raise ValueError(
                    f"an input image is {image.shape[1]}x{image.shape[0]} pixels; the model "
                    f"takes {self.side}x{self.side} ({self.settings}.reference_resolution)."
                )
        key = hashlib.sha256(b"".join(image.tobytes() for image in images)).hexdigest()
        if key not in self.kept:
            if len(self.kept) >= KEPT_REFERENCES:
                self.kept.pop(next(iter(self.kept)))
            self.kept[key] = reference_rows(*self.references(images), self.width)
        return self.kept[key]

    def __call__(self, prompts, input_images=None) -> jax.Array:
        text = np.asarray(self.text.conditioning(prompts), np.float32)
        # A family may widen its rows for the references: the text's zero-padded to `width`.
        text = np.pad(text, ((0, 0), (0, 0), (0, max(0, self.width - text.shape[-1]))))
        rows = np.zeros((len(text), self.rows, text.shape[-1]), np.float32)
        for i, images in enumerate(input_images or ()):
            rows[i] = self.image_rows(images)
        return jnp.asarray(np.concatenate([text, rows], axis=1))
