"""Z-Image end to end on a tiny random folder built with PyTorch (tests/zimage_fixtures.py):
the folder is a ZImagePipeline diffusers loads and samples from."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from zimage_fixtures import RESOLUTION  # noqa: E402

LONG = " ".join(["a photo of a cat"] * 4)  # past the tests' 40 text tokens
PROMPTS = ["a photo of a cat", "two dogs", LONG]
TEXT_TOKENS = 40


@pytest.fixture(scope="module")
def pipe(zimage_folder):
    from diffusers import ZImagePipeline

    return ZImagePipeline.from_pretrained(str(zimage_folder), torch_dtype=torch.float32)


def test_the_tiny_folder_is_a_pipeline_diffusers_samples(pipe):
    import transformers

    assert isinstance(pipe.text_encoder, transformers.Qwen3Model)
    with torch.no_grad():
        images = pipe(
            PROMPTS[:2],
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=2,
            guidance_scale=0.0,
            max_sequence_length=TEXT_TOKENS,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        ).images
    assert images.shape == (2, RESOLUTION, RESOLUTION, 3) and np.isfinite(images).all()
    assert np.abs(images[0] - images[1]).max() > 1e-3  # the prompts condition the image
