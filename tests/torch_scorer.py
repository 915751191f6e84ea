"""A tiny random PyTorch scorer, served behind `--callable=torch_scorer:score` in the tests:
how a user puts a PyTorch model behind the remote-reward protocol."""

import numpy as np
import torch

torch.manual_seed(0)
NET = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 1, 3))


@torch.no_grad()
def score(images, prompts, metadata):
    """images float32 [B, H, W, C] in [0, 1] -> one score per image, with a sub-score."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).mean(1, keepdim=True)
    scores = NET(x).mean(dim=(1, 2, 3))
    return {"scores": scores.tolist(), "sub_scores": {"brightness": x.mean(dim=(1, 2, 3)).tolist()}}
