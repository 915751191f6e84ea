"""The eval reward's curve, drawn with PIL: round ticks, the points where their values say."""

import numpy as np
import pytest
from PIL import Image

from tree_grpo_jax.run import reporting


@pytest.mark.parametrize(
    "low, high, integer, expected",
    [
        (-0.48, 0.02, False, [-0.5, -0.4, -0.3, -0.2, -0.1, 0.0, 0.1]),
        (-0.5, 10.5, True, [-2, 0, 2, 4, 6, 8, 10, 12]),
        (0.0, 0.004, False, [0.0, 0.001, 0.002, 0.003, 0.004]),
        (-0.05, 0.05, True, [-1, 0, 1]),  # whole iterations, however narrow the range
    ],
)
def test_nice_ticks_are_round_and_cover_the_range(low, high, integer, expected):
    ticks = reporting.nice_ticks(low, high, integer=integer)
    np.testing.assert_allclose(ticks, expected, atol=1e-12)


def _curve_pixels(path) -> np.ndarray:
    """(row, column) of every pixel near the curve's color."""
    pixels = np.asarray(Image.open(path).convert("RGB"), np.int32)
    near = np.abs(pixels - np.asarray(reporting.CURVE_COLOR)).sum(-1) < 40
    return np.argwhere(near)


def test_the_curve_goes_where_its_values_go(tmp_path):
    rising = reporting.save_curve(str(tmp_path / "up.png"), [0, 5, 10], [-1.0, -0.5, 0.0], "r", "t")
    falling = reporting.save_curve(
        str(tmp_path / "dn.png"), [0, 5, 10], [0.0, -0.5, -1.0], "r", "t"
    )
    assert Image.open(rising).size == reporting.CURVE_SIZE
    for path, sign in ((rising, 1), (falling, -1)):
        at = _curve_pixels(path)
        first = at[at[:, 1] <= at[:, 1].min() + 2, 0].mean()  # rows of the leftmost points
        last = at[at[:, 1] >= at[:, 1].max() - 2, 0].mean()
        assert sign * (first - last) > 100, (path, first, last)  # a higher value is drawn higher
        # the middle point lies half way between the ends, where a straight line puts it
        middle = at[np.abs(at[:, 1] - at[:, 1].mean()) <= 2, 0].mean()
        assert abs(middle - (first + last) / 2) < 6


def test_one_point_and_a_flat_curve_are_drawn(tmp_path):
    for steps, values in (([0], [-0.46]), ([0, 1, 2], [0.25, 0.25, 0.25])):
        path = reporting.save_curve(str(tmp_path / "c.png"), steps, values, "reward", "flat")
        assert len(_curve_pixels(path)) > 20
