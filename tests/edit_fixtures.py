"""Editing prompts for the tests of the editing families (FLUX.1-Kontext, FLUX.2): a prompt
file whose rows name an input image beside an instruction."""

from __future__ import annotations

import json

from PIL import Image

ROWS = [("make the digit bold", 3), ("turn the digit upside down", 7)]


def prompt_file(folder, image_of):
    """`folder`/edits.jsonl, one row per ROWS naming `folder`/digits/<value>.png (relative),
    the picture `image_of(value)` (uint8 RGB)."""
    (folder / "digits").mkdir()
    lines = []
    for prompt, value in ROWS:
        Image.fromarray(image_of(value)).save(folder / "digits" / f"{value}.png")
        lines.append(json.dumps({"prompt": prompt, "image": f"digits/{value}.png"}))
    path = folder / "edits.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
