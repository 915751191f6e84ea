"""The loop-counted FLOPs of compiled programs against independent counts: the loop body
compiled on its own times the trip count, the same transformer compiled with its blocks
unrolled, the analytic count of a transformer forward from its weights and sequence, and the
rollout's denoiser rows times one row's FLOPs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.random_models import FLUX1_DEV
from tree_grpo_jax import methods
from tree_grpo_jax.core import rollout
from tree_grpo_jax.models.flux import load, transformer
from tree_grpo_jax.plan.program_cost import program_cost

N = 256


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def _body(c, w):
    return jnp.tanh(c @ w) * 0.5


def _xla(compiled, key="flops"):
    return compiled.cost_analysis()[key]


@pytest.fixture(scope="module")
def square():
    return jax.ShapeDtypeStruct((N, N), jnp.float32)


@pytest.fixture(scope="module")
def body_once(square):
    return _compiled(_body, square, square)


def test_a_scan_of_ten_counts_ten_bodies(square, body_once):
    def ten(x, w):
        return jax.lax.scan(lambda c, _: (_body(c, w), None), x, None, length=10)[0]

    compiled = _compiled(ten, square, square)
    cost = program_cost(compiled)
    # XLA's own figure counts the body once: the reason for this module
    np.testing.assert_allclose(_xla(compiled), _xla(body_once), rtol=0.01)
    np.testing.assert_allclose(cost.flops, 10 * _xla(body_once), rtol=0.01)
    np.testing.assert_allclose(
        cost.transcendentals, 10 * _xla(body_once, "transcendentals"), rtol=0.01
    )
    assert cost.bytes_accessed >= 10 * _xla(body_once, "bytes accessed")
    assert [(loop.trips, loop.runs) for loop in cost.loops] == [(10, 1)]


def test_nested_loops_multiply(square, body_once):
    def nested(x, w):
        def outer(c, _):
            inner = jax.lax.scan(lambda d, _: (_body(d, w), None), c, None, length=3)[0]
            return _body(inner, w), None

        return jax.lax.scan(outer, x, None, length=4)[0]

    cost = program_cost(_compiled(nested, square, square))
    np.testing.assert_allclose(cost.flops, (4 * 3 + 4) * _xla(body_once), rtol=0.01)
    assert sorted((loop.trips, loop.runs) for loop in cost.loops) == [(3, 4), (4, 1)]


def test_a_loop_of_unknown_trips_counts_once_until_told(square, body_once):
    def moving(x, w, n):
        return jax.lax.fori_loop(0, n, lambda i, c: _body(c, w), x)

    cost = program_cost(_compiled(moving, square, square, jnp.int32(5)))
    assert [loop.trips for loop in cost.unknown_loops] == [None]
    np.testing.assert_allclose(cost.flops, _xla(body_once), rtol=0.01)
    fixed = program_cost(_compiled(lambda x, w: moving(x, w, 7), square, square))
    assert fixed.unknown_loops == ()
    np.testing.assert_allclose(cost.with_trips([7]).flops, fixed.flops, rtol=0.01)
    np.testing.assert_allclose(cost.with_trips([7]).flops, 7 * _xla(body_once), rtol=0.01)
    with pytest.raises(ValueError, match="2 trip counts given for the 1 loops"):
        cost.with_trips([1, 2])


# ---------------------------------------------------------------------------------------------
# A FLUX transformer forward (two double-stream and two single-stream blocks, XLA attention).

HEADS, HEAD_DIM, SIDE, TEXT = 4, 64, 32, 64
WIDTH = HEADS * HEAD_DIM
SMALL_FLUX = dict(
    FLUX1_DEV,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=HEAD_DIM,
    num_attention_heads=HEADS,
    joint_attention_dim=64,
    pooled_projection_dim=32,
    axes_dims_rope=(16, 24, 24),
)
TEXT_STREAM = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff_context")


def _tokens_through(path: str, image: int, text: int) -> int:
    """How many tokens of one sample a kernel multiplies: the modulations and embedders of the
    timestep, guidance and pooled text act once per sample; the double-stream blocks keep
    the text and image streams apart; the single-stream blocks see both."""
    names = path.split("/")
    if "time_text_embed" in names or any(n.startswith("norm") for n in names):
        return 1
    if names[0].startswith("single_transformer_blocks"):
        return image + text
    if names[0] == "context_embedder" or any(n in TEXT_STREAM for n in names):
        return text
    return image  # x_embedder, proj_out, the double blocks' image stream


def _analytic_flops(params, image: int, text: int, layers: int) -> float:
    """2 x (kernel size) x (tokens through it) summed over the kernels, plus attention's
    4 x sequence^2 x width per layer (the scores and the weighted sum)."""
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = "/".join(str(getattr(p, "key", p)) for p in path)
        if keys.endswith("kernel"):
            total += 2 * np.prod(leaf.shape) * _tokens_through(keys, image, text)
    return total + layers * 4 * (image + text) ** 2 * WIDTH


def _flux_forward(scan_layers: bool):
    module = transformer.transformer_module(
        SMALL_FLUX, jnp.float32, attention="xla", scan_layers=scan_layers
    )
    params = load.abstract_params(module)
    channels = SMALL_FLUX["in_channels"] // transformer.LATENT_PATCH**2
    x = jax.ShapeDtypeStruct((1, channels, SIDE, SIDE), jnp.float32)
    t = jax.ShapeDtypeStruct((1,), jnp.float32)
    width = max(SMALL_FLUX["joint_attention_dim"], SMALL_FLUX["pooled_projection_dim"])
    cond = jax.ShapeDtypeStruct((1, TEXT + 1, width), jnp.float32)
    return params, _compiled(load.make_denoise(module, 3.5), params, x, t, cond)


def test_a_scanned_transformer_matches_its_unrolled_twin_and_the_analytic_count():
    params, scanned = _flux_forward(scan_layers=True)
    _, unrolled = _flux_forward(scan_layers=False)
    cost = program_cost(scanned)
    assert sorted(loop.trips for loop in cost.loops) == [2, 2]  # the two runs of blocks
    assert program_cost(unrolled).loops == ()
    np.testing.assert_allclose(cost.flops, _xla(unrolled), rtol=0.01)
    image = (SIDE // transformer.LATENT_PATCH) ** 2
    analytic = _analytic_flops(params, image, TEXT, layers=4)
    np.testing.assert_allclose(cost.flops, analytic, rtol=0.02)
    assert cost.xla_flops < 0.75 * analytic  # read directly, two of the blocks are missing


# ---------------------------------------------------------------------------------------------
# The rollout: every denoiser row it runs, at each window position of a sliding window.


def test_the_rollout_costs_its_denoiser_rows():
    from small_configs import small_config

    from tree_grpo_jax.models import registry
    from tree_grpo_jax.plan import memory_plan

    c = small_config("treegrpo")  # guidance on: two rows per node and step
    c.sampling.num_steps = 6
    c.tree.window_slide_every = 1
    plan = memory_plan.plan_memory(c, only=["rollout"])
    cost = plan.programs[0].cost
    model = registry.abstract_model(c.model, seed=c.seed)
    x = jax.ShapeDtypeStruct((1, *model.sample_shape), jnp.float32)
    t = jax.ShapeDtypeStruct((1,), jnp.float32)
    cond = jax.ShapeDtypeStruct((1, *model.cond_shape), jnp.float32)
    per_row = program_cost(_compiled(model.denoise, model.params, x, t, cond))
    method = methods.get(c.tree.method)
    seen = set()
    for iteration in range(method.run_spec(c).window_positions):
        trips = rollout.moving_ode_trips(method.run_spec(c), method.window_start_at(c, iteration))
        seen.add(trips)
        rows = method.training_counts(c, iteration)["rollout_rows"] * c.prompts.batch_size
        np.testing.assert_allclose(cost.with_trips(trips).flops, rows * per_row.flops, rtol=0.01)
    assert len(seen) > 2  # the window moved, and with it the rows of the ODE loops
