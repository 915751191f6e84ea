"""Temporal consistency of videos: how far a video moves from one frame to the next.

For a video of T >= 2 frames whose frames embed to e_0, ..., e_{T-1} (the embedding the
diversity measure uses, `evaluation.diversity`: CLIP's image features, the model family's
own, or the pixels), its temporal distance is

    d = 1 / (T - 1) * sum_{t=0}^{T-2} || e_{t+1} - e_t ||_2

(Euclidean). A video that does not change has d = 0; a flickering one a large d. A run's
figure (`temporal_distance`, beside `diversity`) is the mean of d over its eval videos.
Lower is steadier; a reward that turns a video into a still drives it towards 0, so it is
read with the diversity and the rewards, never alone. Images have no such figure.
"""

from __future__ import annotations

import numpy as np


def distances(frame_embeddings) -> np.ndarray:
    """[B, T, D] -> [B]: each video's mean distance between consecutive frames' embeddings."""
    e = np.asarray(frame_embeddings, np.float64)
    if e.ndim != 3 or e.shape[1] < 2:
        raise ValueError(f"temporal distance needs [videos, T >= 2, features], got {e.shape}.")
    return np.linalg.norm(np.diff(e, axis=1), axis=-1).mean(axis=1)
