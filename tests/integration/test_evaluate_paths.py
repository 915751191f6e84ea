"""The run's evaluation and the evaluate command measure alike: on one trainer (built as the
command builds it), one set of params and the same prompts and noises, `Evaluator.evaluate`'s
figures equal the command's chunked ones; the diversity equals a pair loop written here over
the returned pictures' embeddings."""

import itertools

import jax
import numpy as np
import pytest
from small_configs import small_config

K = 2  # noises a prompt
METRICS = ["jpeg_compressibility", "digit_accuracy"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """(trainer, its figures, its pictures, the command's row and grid) for params moved
    away from the base, so that the KL and the samples differ from the base's."""
    from tree_grpo_jax.cli import evaluate
    from tree_grpo_jax.run.build import setup

    base = small_config("treegrpo")
    # the whole eval set one chunk, as the run's own evaluation samples it
    chunk = base.prompts.eval_count
    config = evaluate._evaluation_config(base, K, METRICS, with_kl=True, chunk=chunk)
    trainer, state = setup(config, str(tmp_path_factory.mktemp("trainer")))
    leaves, tree = jax.tree_util.tree_flatten(state.params)
    keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
    params = jax.tree_util.tree_unflatten(
        tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    )
    metrics, images = trainer.evaluator.evaluate(params)
    prompts = list(trainer.evaluator.prompts)
    # 3 prompts a chunk: the second chunk is topped up, as the command's last chunks are
    chunks = evaluate._Chunks(str(tmp_path_factory.mktemp("out")), {"test": 1})
    row, grid = evaluate._evaluate_model(
        trainer.evaluator, params, "step 1", prompts, K, 3, chunks, True
    )
    return trainer, metrics, np.asarray(images), row, grid


def test_the_runs_evaluation_and_the_commands_agree(measured):
    trainer, metrics, images, row, grid = measured
    prompts = list(trainer.evaluator.prompts)
    assert len(set(prompts)) == len(prompts) == 4  # a text's samples are one prompt's K noises
    assert sorted(trainer.evaluator.rewards) == sorted(METRICS)
    for name in METRICS:
        np.testing.assert_allclose(row[name]["mean"], metrics[name], rtol=1e-6)
    # the trained reward, scored by the run as its reward and by the command as a metric
    np.testing.assert_allclose(row["jpeg_compressibility"]["mean"], metrics["reward_mean"])
    np.testing.assert_allclose(row["jpeg_compressibility"]["std"], metrics["reward_std"])
    np.testing.assert_allclose(row["diversity"]["mean"], metrics["diversity"], rtol=1e-5)
    assert metrics["kl"] > 1e-3  # the moved params' trajectories differ from the base's
    np.testing.assert_allclose(row["kl"]["mean"], metrics["kl"], rtol=1e-4)
    # the same pictures: the command's grid is [K, prompts, ...], the run's rows sample-major
    np.testing.assert_allclose(grid.reshape(images.shape), images, atol=1e-5)


def test_the_diversity_is_the_mean_pair_distance_of_each_prompts_samples(measured):
    trainer, metrics, images, _, _ = measured
    p = len(trainer.evaluator.prompts)
    embeddings = np.asarray(trainer.evaluator.embed(images), np.float64)
    per_prompt = []
    for prompt in range(p):
        rows = [j * p + prompt for j in range(K)]  # sample-major: row j * P + p
        pairs = itertools.combinations(rows, 2)
        per_prompt.append(
            np.mean([np.sqrt(np.sum((embeddings[a] - embeddings[b]) ** 2)) for a, b in pairs])
        )
    # the samples differ, and not all by the same amount: a wrong pairing would show
    assert min(per_prompt) > 1e-3 and np.ptp(per_prompt) > 1e-3
    np.testing.assert_allclose(metrics["diversity"], np.mean(per_prompt), rtol=1e-6)
