"""Pickled reward-model releases -> folders the JAX reward loader reads (safetensors + JSON).

Run it as `python -m tree_grpo_jax.rewards.convert {hpsv2,aesthetic,imagereward} ...`
(see `--help`).

errors        `ConversionError` (one sentence), message helpers, the optional torch/transformers
dtypes        the `--dtype` choices and the casts of the written weights
reading       the pickled torch release as numpy arrays; a transformers CLIP folder's safetensors
clip_configs  open_clip model configs -> transformers CLIPConfigs, and their expected shapes
keys          the open_clip -> transformers key plan and `convert_open_clip`
tokenizer     the CLIP tokenizer files: from open_clip's BPE or a Hugging Face folder
aesthetic     the LAION aesthetic MLP and its CLIP image tower (`convert_aesthetic`)
imagereward   the ImageReward release and its BERT tokenizer (`convert_imagereward`)
writing       the `--out` check and the staged write of the folder
commands      the `hpsv2`, `aesthetic` and `imagereward` subcommands and `main`
"""

from tree_grpo_jax.rewards.convert.aesthetic import (
    AESTHETIC_KEYS,
    AESTHETIC_LINEARS,
    check_aesthetic_mlp,
    convert_aesthetic,
)
from tree_grpo_jax.rewards.convert.clip_configs import (
    LAYER_NORM_EPS,
    VIT_H_14,
    hf_clip_config,
    read_open_clip_config,
    reference_shapes,
)
from tree_grpo_jax.rewards.convert.commands import (
    FORMAT,
    main,
    run_aesthetic,
    run_hpsv2,
    run_imagereward,
)
from tree_grpo_jax.rewards.convert.dtypes import OUTPUT_DTYPES
from tree_grpo_jax.rewards.convert.errors import ConversionError
from tree_grpo_jax.rewards.convert.imagereward import (
    BLIP_SPECIAL_TOKENS,
    blip_tokenizer,
    convert_imagereward,
    expected_shapes,
    release_config,
    tokenizer_files,
)
from tree_grpo_jax.rewards.convert.keys import convert_open_clip, key_plan
from tree_grpo_jax.rewards.convert.reading import (
    load_checkpoint,
    read_clip_config,
    read_clip_folder,
    to_numpy_state_dict,
)
from tree_grpo_jax.rewards.convert.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    TOKENIZER_FILES,
    check_tokenizer,
    copied_tokenizer_files,
    open_clip_tokenizer_files,
)
from tree_grpo_jax.rewards.convert.writing import check_out_dir, write_folder

__all__ = [
    "AESTHETIC_KEYS",
    "AESTHETIC_LINEARS",
    "BLIP_SPECIAL_TOKENS",
    "BOS_TOKEN",
    "EOS_TOKEN",
    "FORMAT",
    "LAYER_NORM_EPS",
    "OUTPUT_DTYPES",
    "TOKENIZER_FILES",
    "VIT_H_14",
    "ConversionError",
    "blip_tokenizer",
    "check_aesthetic_mlp",
    "check_out_dir",
    "check_tokenizer",
    "convert_aesthetic",
    "convert_imagereward",
    "convert_open_clip",
    "copied_tokenizer_files",
    "expected_shapes",
    "hf_clip_config",
    "key_plan",
    "load_checkpoint",
    "main",
    "open_clip_tokenizer_files",
    "read_clip_config",
    "read_clip_folder",
    "read_open_clip_config",
    "reference_shapes",
    "release_config",
    "run_aesthetic",
    "run_hpsv2",
    "run_imagereward",
    "to_numpy_state_dict",
    "tokenizer_files",
    "write_folder",
]
