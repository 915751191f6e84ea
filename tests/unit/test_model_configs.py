"""The planners' check of a text encoder's width against the transformer's, on configs read
from JSON alone: absent configs or fields pass, a different width is one sentence naming the
file, the field, both widths and what to do."""

from __future__ import annotations

import pytest

from tree_grpo_jax.models.abstract import ModelConfigs
from tree_grpo_jax.models.base import ModelLoadError

T5 = "text_encoder_2/config.json"
CONFIGS = ModelConfigs({T5: {"d_model": 5}, "vae/config.json": {}}, "/pipe", "/pipe")


@pytest.mark.parametrize(
    "configs, file",
    [
        (CONFIGS, T5),  # the same width
        (CONFIGS, "text_encoder/config.json"),  # no such config: nothing to check
        (ModelConfigs({T5: {}}, "/pipe", "/pipe"), T5),  # no such field
    ],
)
def test_a_matching_or_absent_width_passes(configs, file):
    configs.check_width(file, "d_model", 5, "joint_attention_dim", "fix it")


def test_a_different_width_is_one_sentence():
    with pytest.raises(ModelLoadError) as info:
        CONFIGS.check_width(T5, "d_model", 4, "joint_attention_dim", "fix it")
    assert str(info.value) == (
        "/pipe/text_encoder_2/config.json has d_model 5, but the transformer's "
        "joint_attention_dim is 4; fix it."
    )
