"""The tiny model's data: scikit-learn's bundled 8x8 digits, one fixed train/test split."""

from __future__ import annotations

import functools

import numpy as np

TEST_FRACTION = 0.3
SPLIT_SEED = 0


@functools.cache
def _digit_splits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1] in [0, 1]
    labels = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=labels
    )
    return {"train": (x_train, y_train), "test": (x_test, y_test)}


def digits_dataset(split: str) -> tuple[np.ndarray, np.ndarray]:
    """`(images [N, 8, 8, 1] float32 in [0, 1], labels [N] int32)` of the fixed 70/30 split."""
    splits = _digit_splits()
    if split not in splits:
        raise ValueError(f"split must be one of {tuple(splits)}, got {split!r}.")
    images, labels = splits[split]
    return images.copy(), labels.copy()
