"""The tiny random causal VAE (diffusers' `AutoencoderKLWan` and `AutoencoderKLQwenImage`,
one network under two names) that the Wan and Qwen-Image VAE tests build in PyTorch, and its
decode as those pipelines call it."""

import numpy as np
import torch
from sd_fixtures import perturb

Z_DIM = 4
# Four levels as Wan2.1 has (8x in space), two of them doubling the frames (4x in time).
TINY = dict(
    base_dim=8,
    z_dim=Z_DIM,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
)


def random_torch_vae(vae_class, seed):
    """`vae_class` built TINY with random latent statistics and perturbed weights, in eval mode."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = vae_class(
        **TINY,
        latents_mean=rng.normal(0.0, 0.5, Z_DIM).round(4).tolist(),
        latents_std=rng.uniform(0.5, 2.5, Z_DIM).round(4).tolist(),
    )
    perturb(model, generator)  # RMS scales and biases away from ones and zeros
    return model.eval()


def saved_vae_folder(torch_vae, tmp_path_factory, name):
    """`torch_vae` saved as a diffusers `vae/` folder in a fresh temporary folder `name`."""
    path = tmp_path_factory.mktemp(name) / "vae"
    torch_vae.save_pretrained(path, safe_serialization=True)
    return path


def decode_reference(torch_vae, latents):
    """The pipelines' de-normalisation and `vae.decode` of channels-last latents, as
    [B, T, H, W, 3] in [0, 1] (their image processors map [-1, 1] so)."""
    config = torch_vae.config
    z = torch.from_numpy(latents).permute(0, 4, 1, 2, 3)  # -> [B, z, F, h, w]
    mean = torch.tensor(config.latents_mean).view(1, Z_DIM, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(1, Z_DIM, 1, 1, 1)
    with torch.no_grad():
        video = torch_vae.decode(z / inv_std + mean, return_dict=False)[0]
    return (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).numpy()
