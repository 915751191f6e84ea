"""Decoding in parts and scoring each part as it comes (run/scoring.py): the same scores, in
the same order with the same prompts and metadata, as decoding everything and scoring once;
every part's decode dispatched before the first is scored; and, through a training
iteration, the same rewards and weights with one part or several."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax import train
from tree_grpo_jax.run import scoring
from tree_grpo_jax.run.trainer import Trainer


@pytest.mark.parametrize(
    ("per_group", "asked", "expected"),
    [(8, 4, 4), (6, 4, 3), (7, 4, 1), (4, 9, 4), (12, 5, 4), (5, 1, 1), (1, 4, 1)],
)
def test_parts_are_the_largest_divisor_not_above_the_ask(per_group, asked, expected):
    assert scoring.chunk_count(per_group, asked) == expected


def _decode(latents):  # a stand-in decoder: a different image for every row
    return jnp.tanh(latents * 0.5) + 1.0


class _Recorder:
    """A host reward that notes each call; its score mixes the image with its prompt's and
    metadata's numbers, so a row scored beside the wrong prompt gets a different score."""

    on_host = True

    def __init__(self, decodes: list):
        self.calls, self.decodes = [], decodes

    def __call__(self, images, prompts, metadata):
        self.calls.append((len(images), len(self.decodes)))
        images = np.asarray(images, np.float64)
        prompt_number = np.array([float(p.split()[-1]) for p in prompts])
        meta_number = np.array([m["n"] for m in metadata], np.float64)
        scores = images.reshape(len(images), -1).sum(axis=1) + 100 * prompt_number
        parts = {"meta": 1000 * meta_number, "first": images.reshape(len(images), -1)[:, 0]}
        return scores + parts["meta"], parts, np.stack([scores, -scores], axis=1)


@pytest.mark.parametrize(("groups", "per_group", "parts"), [(3, 8, 4), (2, 6, 4), (1, 5, 2)])
def test_parts_score_as_the_whole_batch_in_row_order(groups, per_group, parts):
    rows = groups * per_group
    latents = jax.random.normal(jax.random.PRNGKey(rows), (rows, 2, 3, 1))
    prompts = [f"prompt {i}" for i in range(rows)]
    metadata = [{"n": 7 * i + 1} for i in range(rows)]
    dispatched = []

    def decode(x):
        dispatched.append(x.shape[0])
        return _decode(x)

    reward = _Recorder(dispatched)
    decoded = scoring.decode(decode, latents, groups, parts)
    total, sub, frames = scoring.scored(reward, decoded, prompts, metadata, on_host=True)

    # the reference: every row decoded and scored by hand, one at a time
    images = np.asarray(_decode(latents), np.float64).reshape(rows, -1)
    own = images.sum(axis=1) + 100 * np.arange(rows)
    meta = 1000 * np.array([7 * i + 1 for i in range(rows)], np.float64)
    np.testing.assert_allclose(total, own + meta, rtol=1e-6)
    np.testing.assert_allclose(sub["meta"], meta)
    np.testing.assert_allclose(sub["first"], images[:, 0], rtol=1e-6)
    np.testing.assert_allclose(frames, np.stack([own, -own], axis=1), rtol=1e-6)
    assert len(set(np.round(total, 3))) == rows  # the reference differs row by row

    count = scoring.chunk_count(per_group, parts)
    assert decoded.count == count
    assert dispatched == [rows // count] * count
    # every decode was dispatched before the first part was scored
    assert [c[1] for c in reward.calls] == [count] * count
    assert [c[0] for c in reward.calls] == [rows // count] * count
    np.testing.assert_allclose(np.asarray(decoded.whole, np.float64).reshape(rows, -1), images)


def test_a_reward_on_the_accelerator_gets_the_whole_batch_once():
    latents = jax.random.normal(jax.random.PRNGKey(0), (8, 2, 2, 1))
    reward = _Recorder([])
    decoded = scoring.decode(_decode, latents, groups=2, parts=4)
    prompts, metadata = [f"p {i}" for i in range(8)], [{"n": i} for i in range(8)]
    scoring.scored(reward, decoded, prompts, metadata, on_host=False)
    assert [c[0] for c in reward.calls] == [8]


def _one_iteration(tmp_path, chunks: int, name: str):
    from small_configs import small_config

    c = small_config("treegrpo")
    c.reward_options.decode_chunks = chunks
    trainer, state = train.setup(c, str(tmp_path / name))
    assert isinstance(trainer, Trainer)
    parts = scoring.decode_parts(c.reward_options, trainer.reward.on_host)
    state, metrics = trainer.iteration(state, 0)
    return parts, metrics, jax.device_get(state.params)


@pytest.mark.slow
def test_a_run_trains_the_same_with_one_part_or_several(tmp_path):
    """TreeGRPO on the host-side JPEG reward: decoding in 4 parts gives the rewards and the
    updated weights of decoding at once."""
    parts_1, whole, params_1 = _one_iteration(tmp_path, 1, "one")
    parts_4, chunked, params_4 = _one_iteration(tmp_path, 4, "four")
    assert (parts_1, parts_4) == (1, 4)
    for name in ("reward_mean", "reward_std"):
        assert chunked[name] == pytest.approx(whole[name], rel=1e-6)
    assert whole["reward_std"] > 0
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), params_1, params_4
    )


def test_a_decoder_with_its_weights_runs_on_the_run_devices():
    """`on_each_device`: a `Decoder` (weights kept apart) runs through the per-device program
    and gives what it gives called directly; a `decode` closing over its weights runs as it
    is (the 4-device split: tests/integration/test_sharding.py)."""
    from tree_grpo_jax import sharding
    from tree_grpo_jax.models.base import Decoder

    def apply(params, latents):  # a loop over rows, as the VAEs decode
        return jax.lax.map(lambda z: jnp.tanh(z * params["w"]) + params["b"], latents, batch_size=2)

    decoder = Decoder(apply, {"w": jnp.float32(0.7), "b": jnp.float32(0.1)})
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    latents = jax.random.normal(jax.random.PRNGKey(1), (6, 2, 3, 1))
    run = scoring.on_each_device(decoder, mesh)
    expected = np.tanh(np.asarray(latents) * 0.7) + 0.1  # by hand
    np.testing.assert_allclose(np.asarray(run(latents)), expected, rtol=1e-5, atol=1e-6)
    assert run(latents).sharding.is_equivalent_to(sharding.batch_sharding(mesh), 4)
    assert scoring.on_each_device(_decode, mesh) is _decode
