"""PyTorch conv weights become Flax kernels that compute the same convolution: Conv3d (a video
model's) as Conv2d, checked by running torch.nn.ConvNd and flax.linen.Conv on one random
input, and back again to the PyTorch tensors exactly."""

import flax.linen as nn
import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tree_grpo_jax.weights import convert  # noqa: E402

# windows of different sizes on every axis, and in != out, so a wrong axis order cannot pass
CASES = {
    "conv2d": (torch.nn.Conv2d, (3, 2), (2, 3, 9, 8)),  # input [N, C, H, W]
    "conv3d": (torch.nn.Conv3d, (2, 3, 4), (2, 3, 5, 6, 7)),  # input [N, C, T, H, W]
}


@pytest.mark.parametrize("name", CASES)
def test_a_pytorch_conv_runs_the_same_in_flax(name):
    torch_conv, window, input_shape = CASES[name]
    torch.manual_seed(0)
    conv = torch_conv(3, 5, window, bias=True)
    state = {f"block.conv.{k}": v.detach().numpy() for k, v in conv.state_dict().items()}
    x = np.random.default_rng(1).standard_normal(input_shape).astype(np.float32)
    with torch.no_grad():
        expected = conv(torch.from_numpy(x)).numpy()

    module = nn.Conv(features=5, kernel_size=window, padding="VALID")
    channels_last = np.moveaxis(x, 1, -1)
    shapes = jax.eval_shape(module.init, jax.random.key(0), channels_last)["params"]
    reference = {("block", "conv", *k): v for k, v in convert.shapes_of(shapes).items()}
    params = convert.pytorch_to_flax(state, reference)
    assert params["block"]["conv"]["kernel"].shape == (*window, 3, 5)
    got = module.apply({"params": params["block"]["conv"]}, channels_last)
    np.testing.assert_allclose(np.moveaxis(np.asarray(got), -1, 1), expected, rtol=1e-5, atol=1e-5)

    back = convert.flax_to_pytorch(params)
    assert set(back) == set(state)
    for key, value in state.items():
        np.testing.assert_array_equal(back[key], value)
