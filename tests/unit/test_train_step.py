"""The train step's update on a replicated layout, where it runs on the parameters laid end to
end as one vector, against optax applied array by array: the same AdamW, clipping, weight
decay and gradient accumulation, and the same refusal of a non-finite step."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from tree_grpo_jax import sharding
from tree_grpo_jax.run import train_step
from tree_grpo_jax.run.train_step import StepLayout, TrainState, make_optimizer, make_train_step

LR = 0.05


def _params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "dense": {"kernel": jax.random.normal(k1, (3, 4)), "bias": jnp.zeros((4,))},
        "norm": {"scale": 1.0 + jax.random.normal(k2, (4,))},
        "embedding": jax.random.normal(k3, (2, 2, 3)),
    }


@dataclasses.dataclass(frozen=True)
class _Settings:
    poison: float = 0.0  # added to the loss


def _loss(params, batch, settings=_Settings(), inputs=None):
    """A loss whose gradient differs across the arrays (and across the batches fed)."""
    del inputs
    x = batch @ params["dense"]["kernel"] + params["dense"]["bias"]
    x = x * params["norm"]["scale"]
    loss = jnp.mean(jnp.sin(x) ** 2) + jnp.sum(params["embedding"] ** 3) * 0.1
    return loss + settings.poison, {}


def _reference_grads(params, batch):
    loss_of = lambda p: _loss(p, batch)
    return jax.grad(lambda p: loss_of(p)[0])(params)


def _train_config(
    max_grad_norm: float, grad_accumulation: int, state_dtype: str = "float32"
) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        dict(
            max_grad_norm=max_grad_norm,
            adam_b1=0.9,
            adam_b2=0.99,
            adam_eps=1e-6,
            weight_decay=0.01,
            grad_accumulation=grad_accumulation,
            optimizer_state_dtype=state_dtype,
        )
    )


def _step(train_cfg, params, settings=_Settings()):
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    tx = make_optimizer(train_cfg)
    state = TrainState(jax.tree_util.tree_map(jnp.copy, params), tx.init(params))  # donated
    shardings = sharding.param_shardings(mesh, jax.eval_shape(lambda s: s, state))
    step = make_train_step(tx, settings, mesh, shardings, StepLayout(_loss))
    return tx, state, step


@pytest.mark.parametrize(
    "max_grad_norm, grad_accumulation, state_dtype",
    [(0.3, 1, "float32"), (100.0, 1, "float32"), (0.3, 2, "float32"), (0.3, 2, "bfloat16")],
)
def test_one_vector_update_is_optax_array_by_array(max_grad_norm, grad_accumulation, state_dtype):
    params = _params(jax.random.key(0))
    assert train_step._one_vector_fits(params)
    train_cfg = _train_config(max_grad_norm, grad_accumulation, state_dtype)
    tx, state, step = _step(train_cfg, params)
    reference_params, reference_opt = params, tx.init(params)
    norms = []
    for i in range(4):
        batch = jax.random.normal(jax.random.key(10 + i), (8, 3))
        state, metrics = step(state, batch, None, None, None, None, jnp.float32(LR))
        grads = _reference_grads(reference_params, batch)
        updates, reference_opt = tx.update(grads, reference_opt, reference_params)
        reference_params = jax.tree_util.tree_map(
            lambda p, u: p - LR * u, reference_params, updates
        )
        np.testing.assert_allclose(metrics["grad_norm"], optax.global_norm(grads), rtol=1e-5)
        norms.append(float(optax.global_norm(grads)))
        assert bool(metrics["finite"])
        for got, want in zip(
            jax.tree_util.tree_leaves((state.params, state.opt_state)),
            jax.tree_util.tree_leaves((reference_params, reference_opt)),
            strict=True,
        ):
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert jax.tree_util.tree_structure(state.opt_state) == jax.tree_util.tree_structure(
        tx.init(params)
    )
    moved = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(params), strict=True
        )
    )
    assert moved > 1e-3  # the steps changed the parameters
    if max_grad_norm < 1:
        assert min(norms) > max_grad_norm  # the clipping acted


def test_a_non_finite_loss_leaves_the_state_as_it_was():
    params = _params(jax.random.key(1))
    _, state, step = _step(_train_config(1.0, 1), params, _Settings(poison=float("nan")))
    before = jax.tree_util.tree_map(np.asarray, state)
    state, metrics = step(state, jnp.ones((8, 3)), None, None, None, None, jnp.float32(LR))
    assert not bool(metrics["finite"])
    for got, want in zip(
        jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(before), strict=True
    ):
        np.testing.assert_array_equal(got, want)


def test_the_one_vector_program_is_a_fraction_of_the_per_array_one():
    params = {f"layer{i}": {"w": jnp.ones((4, 4)), "b": jnp.ones((4,))} for i in range(20)}
    tx = make_optimizer(_train_config(1.0, 1))
    state = TrainState(params, tx.init(params))
    grads = jax.tree_util.tree_map(jnp.ones_like, params)

    def operations(one_vector: bool) -> int:
        apply = lambda s, g: train_step._apply(tx, s, g, LR, one_vector=one_vector)  # noqa: E731
        return jax.jit(apply).lower(state, grads).as_text().count(" = ")

    assert operations(True) * 3 < operations(False)


def test_mixed_dtypes_or_a_single_array_keep_the_per_array_update():
    assert not train_step._one_vector_fits({"a": jnp.ones(3), "b": jnp.ones(3, jnp.bfloat16)})
    assert not train_step._one_vector_fits({"a": jnp.ones(3)})
    big = jax.ShapeDtypeStruct((train_step.ONE_VECTOR_MAX_ELEMENTS, 2), jnp.float32)
    assert not train_step._one_vector_fits({"a": big, "b": big})


def test_bfloat16_state_is_adam_in_float32_with_its_moments_rounded_to_bfloat16():
    """train.optimizer_state_dtype="bfloat16": Adam's step is the float32 formula on the
    moments as kept, and the new moments are kept rounded to bfloat16 (numpy reference);
    float32 is optax's own Adam."""
    b1, b2, eps = 0.9, 0.99, 1e-6
    tx = train_step._adam(b1, b2, eps, "bfloat16")
    params = _params(jax.random.key(2))
    state = tx.init(params)
    assert {x.dtype for x in jax.tree_util.tree_leaves((state.mu, state.nu))} == {
        jnp.dtype(jnp.bfloat16)
    }
    to_bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)  # noqa: E731
    mu = {k: np.zeros(np.shape(v), np.float32) for k, v in _flat(params).items()}
    nu = dict(mu)
    for t in range(1, 6):
        grads = jax.tree_util.tree_map(
            lambda x, t=t: jax.random.normal(jax.random.key(t), x.shape) * 10.0**-t, params
        )
        updates, state = tx.update(grads, state, params)
        got_updates, got_mu, got_nu = _flat(updates), _flat(state.mu), _flat(state.nu)
        for k, g in _flat(grads).items():
            g = np.asarray(g, np.float32)
            m = b1 * mu[k] + (1 - b1) * g
            v = b2 * nu[k] + (1 - b2) * g * g
            want = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
            np.testing.assert_allclose(got_updates[k], want, rtol=1e-4, atol=1e-6)
            mu[k], nu[k] = to_bf16(m), to_bf16(v)
            # rounded to the nearest bfloat16 (one step either way where float32 ties)
            for got, kept in ((got_mu[k], mu[k]), (got_nu[k], nu[k])):
                assert got.dtype == jnp.bfloat16
                np.testing.assert_allclose(np.asarray(got, np.float32), kept, rtol=2**-8)
    reference = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
    assert type(train_step._adam(b1, b2, eps, "float32")) is type(reference)


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}
