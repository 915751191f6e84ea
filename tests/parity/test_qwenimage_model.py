"""Qwen-Image end to end on a tiny random folder built with PyTorch
(tests/qwenimage_fixtures.py): the folder is a QwenImagePipeline diffusers loads and samples
from. Classifier-free guidance stays off throughout (`true_cfg_scale=1`, no negative prompt):
the pipeline's true CFG rescales the guided prediction to the conditional one's norm, which
is not the package's guidance, and the denoiser here is the conditional prediction."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from qwenimage_fixtures import RESOLUTION  # noqa: E402

PROMPTS = ["a photo of a cat", "two dogs"]


@pytest.fixture(scope="module")
def pipe(qwenimage_folder):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(str(qwenimage_folder), torch_dtype=torch.float32)


def test_the_tiny_folder_is_a_pipeline_diffusers_samples(pipe):
    import transformers

    assert isinstance(pipe.text_encoder, transformers.Qwen2_5_VLForConditionalGeneration)
    assert pipe.vae_scale_factor == 8
    with torch.no_grad():
        images = pipe(
            list(PROMPTS),
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=2,
            true_cfg_scale=1.0,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        ).images
    assert images.shape == (2, RESOLUTION, RESOLUTION, 3) and np.isfinite(images).all()
    assert np.abs(images[0] - images[1]).max() > 1e-3  # the prompts condition the image
