"""The embedded tiny model: shipped weights load, sample recognizable digits, and round-trip."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_grpo_jax.core import sampling
from tree_grpo_jax.models import load_model
from tree_grpo_jax.models.base import DDIMScheduleConfig, FlowScheduleConfig, Sampling
from tree_grpo_jax.models.tiny import classifier, networks, tokenizer
from tree_grpo_jax.models.tiny.grammar import (
    DIGIT_PROMPTS,
    STYLED_PROMPTS,
    digit_prompt,
    prompt_digit,
)
from tree_grpo_jax.models.tiny.model import TinyModel, build_tiny, load_tiny
from tree_grpo_jax.models.tiny.weights import load_weights, save_weights


@pytest.fixture(scope="module")
def ddim_model():
    return load_tiny("ddim")


def _guided_ddim_sample(model, prompts, key, num_steps, guidance):
    """Deterministic DDIM (eta 0) with classifier-free guidance, one step at a time."""
    schedule = sampling.make_ddim_schedule(num_steps, eta=0.0)
    cond = model.encode_prompts(prompts)
    uncond = jnp.broadcast_to(model.encode_prompts([""]), cond.shape)
    denoise = jax.jit(model.denoise)
    x = jax.random.normal(key, (len(prompts), *model.sample_shape))
    for i in range(num_steps):
        t = jnp.full((2 * len(prompts),), schedule.timesteps[i])
        out = denoise(model.params, jnp.concatenate([x, x]), t, jnp.concatenate([cond, uncond]))
        eps_c, eps_u = jnp.split(out, 2)
        eps = eps_u + guidance * (eps_c - eps_u)
        # DDIM's eta-0 update written out: predicted x0, then re-noised to the next level.
        a, a_prev = schedule.alpha_bar[i], schedule.alpha_bar_prev[i]
        x0 = (x - jnp.sqrt(1 - a) * eps) / jnp.sqrt(a)
        x = jnp.sqrt(a_prev) * x0 + jnp.sqrt(1 - a_prev) * eps
    return model.decode(x)


def test_shipped_ddim_model_interface(ddim_model):
    assert isinstance(ddim_model, TinyModel) and ddim_model.kind == "ddim"
    assert ddim_model.schedule_config == DDIMScheduleConfig(prediction_type="epsilon")
    assert ddim_model.prompts == DIGIT_PROMPTS
    assert ddim_model.styled_prompts == STYLED_PROMPTS
    assert ddim_model.sample_shape == (1, 8, 8)
    cond = ddim_model.encode_prompts(list(DIGIT_PROMPTS) * 2)
    assert cond.shape == (20, tokenizer.MAX_LENGTH, networks.TEXT_CONFIG["hidden_size"])
    assert cond.dtype == jnp.float32
    x = jax.random.normal(jax.random.key(0), (20, 1, 8, 8))
    eps = jax.jit(ddim_model.denoise)(ddim_model.params, x, jnp.full((20,), 500), cond)
    assert eps.shape == x.shape
    images = ddim_model.decode(x)
    assert images.shape == (20, 8, 8, 1)
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0
    assert load_tiny("ddim").denoise is ddim_model.denoise  # one function, one compile


def test_prompts_encode_differently(ddim_model):
    cond = np.asarray(ddim_model.encode_prompts([*DIGIT_PROMPTS, "", STYLED_PROMPTS[0]]))
    flat = cond.reshape(len(cond), -1)
    distances = np.linalg.norm(flat[:, None] - flat[None], axis=-1)
    off_diagonal = distances[~np.eye(len(cond), dtype=bool)]
    assert off_diagonal.min() > 1e-3


def test_ddim_samples_are_the_prompted_digits(ddim_model):
    prompts = list(DIGIT_PROMPTS)
    images = _guided_ddim_sample(ddim_model, prompts, jax.random.key(0), num_steps=10, guidance=3.0)
    predicted = np.argmax(np.asarray(classifier.digit_log_probs(images)), axis=-1)
    correct = predicted == np.arange(10)
    # The shipped weights get 99% of such samples right (README); 7/10 leaves room for noise.
    assert correct.sum() >= 7, f"only {correct.sum()}/10 samples show the prompted digit"


def test_flow_twin_loads_and_denoises():
    model = load_tiny("flow")
    assert model.kind == "flow" and model.schedule_config == FlowScheduleConfig()
    cond = model.encode_prompts(list(DIGIT_PROMPTS) * 2)
    x = jax.random.normal(jax.random.key(1), (20, 1, 8, 8))
    t = model.make_schedule(10, Sampling()).timesteps[:1].repeat(20)
    v = jax.jit(model.denoise)(model.params, x, t, cond)
    assert v.shape == x.shape and bool(jnp.all(jnp.isfinite(v)))


def test_weights_round_trip_through_the_loader(tmp_path):
    weights = networks.random_weights(seed=3)
    path = tmp_path / "tiny_flow.msgpack"
    save_weights(path, weights, "flow", storage_dtype=np.float32)
    loaded = load_weights(path, "flow")
    jax.tree.map(np.testing.assert_array_equal, loaded, weights)
    with pytest.raises(ValueError, match="kind 'flow'; expected format 1 of kind 'ddim'"):
        load_weights(path, "ddim")
    model = load_tiny("flow", path=path)
    jax.tree.map(np.testing.assert_array_equal, model.params, weights["unet"])


def test_build_tiny_is_seeded_and_bf16_ready():
    a, b = build_tiny("ddim", seed=0), build_tiny("ddim", seed=0)
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
    c = build_tiny("ddim", seed=1)
    pairs = zip(jax.tree.leaves(a.params), jax.tree.leaves(c.params))
    assert any(not np.array_equal(x, y) for x, y in pairs)
    half = build_tiny("flow", seed=0, dtype=jnp.bfloat16)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(half.params))


def test_prompt_digit_and_tokenizer():
    assert [prompt_digit(p) for p in DIGIT_PROMPTS] == list(range(10))
    assert prompt_digit("a thick handwritten digit seven") == 7
    with pytest.raises(ValueError, match="names no digit"):
        prompt_digit("a handwritten letter")
    ids, mask = tokenizer.tokenize(["", "a thin handwritten digit two"])
    assert ids[0, :2].tolist() == [tokenizer.BOS_ID, tokenizer.EOS_ID] and mask[0].sum() == 2
    assert mask[1].sum() == 7 and ids[1, 6] == tokenizer.EOS_ID
    with pytest.raises(ValueError, match="at most"):
        tokenizer.tokenize(["a " * 10])
    assert digit_prompt(7, "thick") == "a thick handwritten digit seven"
    assert all(tokenizer.UNK_ID not in tokenizer.tokenize([p])[0] for p in STYLED_PROMPTS)


def test_make_schedule_reads_the_sampling_options():
    """DDIM twins read `eta`, flow twins `noise_level` and `shift`, from any object."""
    options = types.SimpleNamespace(eta=0.3, noise_level=0.5, shift=3.0)
    ddim = build_tiny("ddim").make_schedule(10, options)
    expected = sampling.make_ddim_schedule(10, eta=0.3)
    jax.tree.map(np.testing.assert_array_equal, ddim, expected)
    flow = build_tiny("flow").make_schedule(10, options)
    expected = sampling.make_flow_schedule(10, shift=3.0, noise_level=0.5)
    jax.tree.map(np.testing.assert_array_equal, flow, expected)


def test_load_model_by_name():
    config = lambda name: types.SimpleNamespace(name=name, path="", compute_dtype="float32")
    shipped = load_model(config("tiny_flow"))
    assert shipped.name == "tiny-flow" and shipped.kind == "flow"
    random = load_model(config("random_tiny"), seed=1)
    jax.tree.map(np.testing.assert_array_equal, random.params, build_tiny("ddim", seed=1).params)
    with pytest.raises(ValueError, match="unknown model"):
        load_model(config("nope"))
