"""`models.clip` against transformers' PyTorch CLIP on tiny random configs (weights converted
by `weights.convert`, as the loaders convert them). (Against transformers' former Flax CLIP,
bit for bit: tests/parity/test_flax_references.py.)"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from clip_fixtures import VISION, features  # the reward folders' tiny vision tower

from tree_grpo_jax.models import clip, clip_files
from tree_grpo_jax.models.base import ModelLoadError
from tree_grpo_jax.weights import convert

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 2e-6  # float32 against PyTorch, relative to the largest output (4.8e-7 seen)
EOS = 5  # the real eos id of the non-legacy configs (the legacy rule reads 2)
TEXT = dict(
    vocab_size=40,
    hidden_size=24,
    intermediate_size=29,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=12,
    projection_dim=16,
    bos_token_id=1,
    pad_token_id=EOS,
)
# (hidden_act, eos_token_id): both activations, the legacy pooling rule and the first-eos one
CASES = [("quick_gelu", 2), ("gelu", EOS)]


def _text_config(act, eos, **extra):
    return transformers.CLIPTextConfig(hidden_act=act, eos_token_id=eos, **TEXT, **extra)


def _clip_config(act, eos):
    return transformers.CLIPConfig(
        text_config=dict(hidden_act=act, eos_token_id=eos, **TEXT),
        vision_config=dict(hidden_act=act, **VISION),
        projection_dim=16,
        logit_scale_init_value=2.5,
    )


def _ids_and_mask():
    """Prompts of different lengths, padded with the eos id, and a large id after each eos:
    the two pooling rules then pick different tokens, so a wrong rule is seen."""
    ids = np.full((3, TEXT["max_position_embeddings"]), EOS, np.int32)
    mask = np.zeros_like(ids)
    for row, words in enumerate([[7, 9, 11], [30, 8], [12, 13, 14, 15, 16, 17, 18]]):
        ids[row, 0], ids[row, 1 : len(words) + 1] = 1, words
        ids[row, len(words) + 2] = 39  # after the eos, beyond every word id
        mask[row, : len(words) + 2] = 1
    legacy = clip.pooled_token_index(jnp.asarray(ids), 2)
    first_eos = clip.pooled_token_index(jnp.asarray(ids), EOS)
    assert not np.any(np.asarray(legacy) == np.asarray(first_eos))
    return ids, mask


def _torch_model(cls, config, seed=0):
    torch.manual_seed(seed)
    model = cls(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # noise on every weight, so unit scales and zero biases are not special
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def _converted(model, shapes):
    # transformers 5 names a CLIPTextModel's tensors without `text_model.`; the loaders (and
    # so this test) name them as the hub's files do
    state = clip_files.with_text_prefix({k: v.numpy() for k, v in model.state_dict().items()})
    return convert.pytorch_to_flax(state, convert.shapes_of(shapes), merge_indices=False)


def _close(ours, theirs, atol=ATOL):
    theirs = np.asarray(theirs)
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=atol * np.abs(theirs).max())


@pytest.mark.parametrize("act, eos", CASES)
@pytest.mark.parametrize("projection", [False, True])
@pytest.mark.parametrize("own_config", [False, True], ids=["transformers_config", "TextConfig"])
def test_text_towers_equal_pytorch(act, eos, projection, own_config):
    config = _text_config(act, eos)
    names = ("CLIPTextModelWithProjection", "CLIPTextModel") if projection else ("CLIPTextModel",)
    ours_class = clip.CLIPTextModelWithProjection if projection else clip.CLIPTextModel
    model = _torch_model(getattr(transformers, names[0]), config)
    # the package's own config (the tiny model's, no transformers import) builds the same tower
    ours = clip.TextConfig(hidden_act=act, eos_token_id=eos, **TEXT) if own_config else config
    module = ours_class(ours)
    params = _converted(model, clip.param_shapes(clip.init_text, module))
    ids, mask = _ids_and_mask()
    for attention_mask in (mask, None):  # the pipelines pass none: padding is attended
        with torch.no_grad():
            theirs = model(
                torch.from_numpy(ids).long(),
                attention_mask=None if attention_mask is None else torch.from_numpy(mask),
                output_hidden_states=True,
            )
        out = module.apply({"params": params}, ids, attention_mask, output_hidden_states=True)
        _close(out.last_hidden_state, theirs.last_hidden_state)
        assert len(out.hidden_states) == len(theirs.hidden_states) == TEXT["num_hidden_layers"] + 1
        for a, b in zip(out.hidden_states, theirs.hidden_states, strict=True):
            _close(a, b)
        if projection:
            _close(out.embeds, theirs.text_embeds)
        else:
            _close(out.pooler_output, theirs.pooler_output)


def test_text_config_defaults_are_transformers():
    theirs = transformers.CLIPTextConfig()
    for field in dataclasses.fields(clip.TextConfig):
        assert getattr(theirs, field.name) == field.default, field.name


@pytest.mark.parametrize("act, eos", CASES)
def test_dual_model_equals_pytorch(act, eos):
    config = _clip_config(act, eos)
    model = _torch_model(transformers.CLIPModel, config)
    module = clip.CLIPModel(config)
    params = _converted(model, clip.param_shapes(clip.init_clip, module))
    ids, mask = _ids_and_mask()
    pixels = np.random.default_rng(0).standard_normal((2, 32, 32, 3)).astype(np.float32)
    variables = {"params": params}
    with torch.no_grad():
        t_ids, t_mask = torch.from_numpy(ids).long(), torch.from_numpy(mask)
        t_pixels = torch.from_numpy(pixels).permute(0, 3, 1, 2)
        theirs = model(t_ids, t_pixels, attention_mask=t_mask, output_hidden_states=True)
        text = features(model.get_text_features(t_ids, attention_mask=t_mask))
        image = features(model.get_image_features(t_pixels))
        # the tower itself: transformers 5's CLIPModel output holds the projected pooled token
        # where 4 held the tower's
        tower = model.vision_model(t_pixels, output_hidden_states=True)
    _close(module.apply(variables, ids, mask, method=clip.CLIPModel.get_text_features), text)
    _close(module.apply(variables, pixels, method=clip.CLIPModel.get_image_features), image)
    vision = module.apply(
        variables,
        pixels,
        output_hidden_states=True,
        method=lambda m, x, **o: m.vision_model(x, **o),
    )
    _close(vision.last_hidden_state, tower.last_hidden_state)
    _close(vision.pooler_output, tower.pooler_output)
    for a, b in zip(vision.hidden_states, tower.hidden_states, strict=True):
        _close(a, b)
    per_image, per_text = module.apply(variables, ids, pixels, mask)
    _close(per_image, theirs.logits_per_image)
    _close(per_text, theirs.logits_per_text)


def test_an_activation_it_lacks_is_one_sentence():
    config = _clip_config("gelu_fast", EOS)  # PyTorch has it; transformers' Flax CLIP had not
    with pytest.raises(ModelLoadError) as caught:
        clip.check_activations(config, "x/config.json", "point it at a CLIP folder")
    message = str(caught.value)
    assert message.startswith("x/config.json sets hidden_act 'gelu_fast'")
    assert message.endswith("; point it at a CLIP folder.") and "\n" not in message
    clip.check_activations(_clip_config("quick_gelu", 2), "x", "y")  # known ones pass
