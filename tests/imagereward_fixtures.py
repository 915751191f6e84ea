"""A tiny random ImageReward built from the `image-reward` package's own PyTorch classes.

`ImageReward(med_config)` is constructed as the package builds it, with three changes of
size only: BLIP's `create_vit` returns the package's `VisionTransformer` with a narrow, shallow
configuration (still 224 px, 16 px patches), the med config describes a narrow BERT, and the
MLP head takes that BERT's width. `init_tokenizer` reads a local WordPiece vocabulary in
place of the hub's bert-base-uncased. Every weight is then perturbed, so no norm scale or bias
is special. Tests that need torch and the package import this module.

Importing the package's top level would also import its ReFL trainer and its CLIP and
aesthetic scorers (openai's `clip`, `datasets`); only the model modules are loaded here, with
an empty parent package. transformers 4.x moved three helpers that the package's med.py
imports from `transformers.modeling_utils` to `transformers.pytorch_utils`; they are aliased
back before the import. transformers 5 removed more of what its BLIP code (written for
transformers 4.15) calls; `_transformers_4_api` puts back what scoring reaches, none of it
arithmetic that differs between the two: the `[ENC]` id's old name, weight initialisation
before `post_init` (every weight is replaced by the release's afterwards), an absent head
mask, and the inverted cross-attention mask (all ones over the image tokens: a zero bias).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path

VISION = dict(width=128, depth=2, heads=2)  # head width 64, as ViT-L/16 and BERT-base
TEXT = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=256,
    max_position_embeddings=40,
)
# fmt: off
WORDS = [
    "a", "photo", "of", "the", "an", "cat", "dog", "red", "blue", "green", "big", "small", "on",
    "in", "with", "under", "tree", "house", "car", "sky", "sea", "painting", "portrait", "city",
    "at", "night", "sunset", "mountain", "river", "flower", "two", "three", "happy", "old",
    "man", "woman", "child",
]
# fmt: on
PIECES = ["##s", "##ing", "##ed", "x", "y", "z", ",", "."]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_bert_tokenizer(folder) -> Path:
    """A bert-base-uncased-style tokenizer folder (vocab.txt + configs), tiny."""
    from transformers import BertTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(SPECIALS + WORDS + PIECES) + "\n")
    BertTokenizer(str(folder / "vocab.txt"), do_lower_case=True).save_pretrained(folder)
    return folder


def release_shapes(vocab_size: int) -> dict[str, tuple[int, ...]]:
    """{key: shape} of the tiny release's state dict, as the package's `ImageReward` names
    its tensors (written out by hand, for tests that run without the package)."""
    v, t, f, ffn = (
        VISION["width"],
        TEXT["hidden_size"],
        4 * VISION["width"],
        TEXT["intermediate_size"],
    )
    vit, bert = "blip.visual_encoder.", "blip.text_encoder."
    shapes = {
        vit + "cls_token": (1, 1, v),
        vit + "pos_embed": (1, 197, v),
        vit + "patch_embed.proj.weight": (v, 3, 16, 16),
        vit + "patch_embed.proj.bias": (v,),
        bert + "embeddings.position_ids": (1, TEXT["max_position_embeddings"]),
        bert + "embeddings.word_embeddings.weight": (vocab_size, t),
        bert + "embeddings.position_embeddings.weight": (TEXT["max_position_embeddings"], t),
        "blip.vision_proj.weight": (256, v),
        "blip.vision_proj.bias": (256,),
        "blip.text_proj.weight": (256, t),
        "blip.text_proj.bias": (256,),
    }
    linears = {vit + "norm": (v, None), bert + "embeddings.LayerNorm": (t, None)}
    for i in range(VISION["depth"]):
        b = f"{vit}blocks.{i}."
        linears |= {b + "norm1": (v, None), b + "norm2": (v, None), b + "attn.qkv": (3 * v, v)}
        linears |= {b + "attn.proj": (v, v), b + "mlp.fc1": (f, v), b + "mlp.fc2": (v, f)}
    for i in range(TEXT["num_hidden_layers"]):
        layer = f"{bert}encoder.layer.{i}."
        for name, source in (("attention", t), ("crossattention", v)):
            a = f"{layer}{name}."
            linears |= {a + "self.query": (t, t), a + "self.key": (t, source)}
            linears |= {a + "self.value": (t, source), a + "output.dense": (t, t)}
            linears[a + "output.LayerNorm"] = (t, None)
        linears |= {layer + "intermediate.dense": (ffn, t), layer + "output.dense": (t, ffn)}
        linears[layer + "output.LayerNorm"] = (t, None)
    widths = (t, 1024, 128, 64, 16, 1)
    for i, inp, out in zip((0, 2, 4, 6, 7), widths[:-1], widths[1:]):
        linears[f"mlp.layers.{i}"] = (out, inp)
    for name, (out, inp) in linears.items():
        shapes[f"{name}.weight"] = (out,) if inp is None else (out, inp)
        shapes[f"{name}.bias"] = (out,)
    return shapes


def make_synthetic_release(root, seed: int = 0):
    """(ImageReward.pt, tokenizer folder, state dict) of random tensors in the release's layout,
    for the converter's tests (which need torch but not the package)."""
    import torch

    root = Path(root)
    tokenizer_dir = write_bert_tokenizer(root / "bert-base-uncased")
    generator = torch.Generator().manual_seed(seed)
    vocab = len(SPECIALS + WORDS + PIECES) + 2
    state = {}
    for key, shape in release_shapes(vocab).items():
        if key.endswith("position_ids"):
            state[key] = torch.arange(shape[1]).expand(shape).contiguous()
        else:
            state[key] = 0.05 * torch.randn(shape, generator=generator)
    checkpoint = root / "ImageReward.pt"
    torch.save(state, checkpoint)
    return checkpoint, tokenizer_dir, state


def _no_head_pruning(*args, **kwargs):
    # transformers 5 removed head pruning; med.py imports its helper, which only its
    # `prune_heads` calls and scoring never does
    raise NotImplementedError("head pruning is not part of scoring")


def _release_modules():
    """The package's ImageReward, BLIP and ViT modules, without its top-level imports."""
    import transformers.modeling_utils as modeling_utils
    import transformers.pytorch_utils as pytorch_utils

    for name in ("apply_chunking_to_forward", "find_pruneable_heads_and_indices"):
        if not hasattr(modeling_utils, name):
            setattr(modeling_utils, name, getattr(pytorch_utils, name, _no_head_pruning))
    if not hasattr(modeling_utils, "prune_linear_layer"):
        modeling_utils.prune_linear_layer = pytorch_utils.prune_linear_layer
    if "ImageReward.ImageReward" not in sys.modules:
        spec = importlib.util.find_spec("ImageReward")
        if spec is None:
            raise ImportError("the image-reward package is not installed")
        root = Path(spec.submodule_search_locations[0])
        for name, where in (("ImageReward", root), ("ImageReward.models", root / "models")):
            package = types.ModuleType(name)
            package.__path__ = [str(where)]
            sys.modules.setdefault(name, package)
    release = importlib.import_module("ImageReward.ImageReward")
    blip = importlib.import_module("ImageReward.models.BLIP.blip")
    pretrain = importlib.import_module("ImageReward.models.BLIP.blip_pretrain")
    vit = importlib.import_module("ImageReward.models.BLIP.vit")
    _transformers_4_api(importlib.import_module("ImageReward.models.BLIP.med"))
    return release, blip, pretrain, vit


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _transformers_4_api(med):
    """The `PreTrainedModel` methods of transformers 4 that med.py's BERT calls and
    transformers 5 removed (nothing on transformers 4)."""
    import torch
    from transformers import PreTrainedModel

    if _transformers_major() < 5:
        return
    bert = med.BertPreTrainedModel

    def get_head_mask(self, head_mask, num_hidden_layers):
        assert head_mask is None, "scoring passes no head mask"
        return [None] * num_hidden_layers

    def invert_attention_mask(self, mask):
        # 1 (attend) -> 0, 0 -> the dtype's lowest, broadcast over heads and queries
        mask = mask[:, None, None, :] if mask.dim() == 2 else mask[:, None, :, :]
        return (1.0 - mask.to(self.dtype)) * torch.finfo(self.dtype).min

    initialise = PreTrainedModel.init_weights

    def init_weights(self):
        # transformers 5 initialises in `post_init` (which then calls this again); med.py's
        # BertModel calls `init_weights` alone
        if "all_tied_weights_keys" in self.__dict__:
            initialise(self)
        else:
            self.post_init()

    bert.get_head_mask = get_head_mask
    bert.invert_attention_mask = invert_attention_mask
    bert.init_weights = init_weights


@contextlib.contextmanager
def _tiny_blip(blip, pretrain, vit, tokenizer_dir):
    from transformers import BertTokenizer

    renamed = _transformers_major() >= 5

    class LocalBertTokenizer(BertTokenizer):
        @classmethod
        def from_pretrained(cls, name, *args, **kwargs):
            assert name == "bert-base-uncased", name
            if renamed:  # transformers 5: an instance of this class, for the property below
                return super().from_pretrained(str(tokenizer_dir), *args, **kwargs)
            return BertTokenizer.from_pretrained(str(tokenizer_dir), *args, **kwargs)

        if renamed:
            # transformers 5 names the added special tokens `extra_special_tokens`; BLIP's
            # `init_tokenizer` reads the [ENC] id under the older name

            @property
            def additional_special_tokens_ids(self):
                return self.convert_tokens_to_ids(self.extra_special_tokens)

    def create_vit(kind, image_size, *args, **kwargs):
        encoder = vit.VisionTransformer(
            img_size=image_size,
            patch_size=16,
            embed_dim=VISION["width"],
            depth=VISION["depth"],
            num_heads=VISION["heads"],
        )
        return encoder, VISION["width"]

    saved = blip.BertTokenizer, pretrain.create_vit
    blip.BertTokenizer, pretrain.create_vit = LocalBertTokenizer, create_vit
    try:
        yield
    finally:
        blip.BertTokenizer, pretrain.create_vit = saved


def make_release(root, seed: int = 0):
    """(ImageReward.pt, tokenizer folder, the eval-mode PyTorch `ImageReward`) under `root`."""
    import torch

    root = Path(root)
    tokenizer_dir = write_bert_tokenizer(root / "bert-base-uncased")
    release, blip, pretrain, vit = _release_modules()
    med = dict(
        architectures=["BertModel"],
        attention_probs_dropout_prob=0.1,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        initializer_range=0.02,
        layer_norm_eps=1e-12,
        model_type="bert",
        pad_token_id=0,
        type_vocab_size=2,
        vocab_size=len(SPECIALS + WORDS + PIECES) + 2,  # + BLIP's [DEC] and [ENC]
        encoder_width=768,  # BLIP_Pretrain replaces it with the ViT's width
        add_cross_attention=True,
        **TEXT,
    )
    med_config = root / "med_config.json"
    med_config.write_text(json.dumps(med))
    torch.manual_seed(seed)
    with _tiny_blip(blip, pretrain, vit, tokenizer_dir):
        model = release.ImageReward(med_config=str(med_config), device="cpu")
    model.mlp = release.MLP(TEXT["hidden_size"])
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
        # The release's head starts near zero; unit-variance layers make the score vary.
        for layer in model.mlp.layers:
            if isinstance(layer, torch.nn.Linear):
                scale = layer.in_features**-0.5
                layer.weight.copy_(scale * torch.randn(layer.weight.shape, generator=generator))
    model.eval()
    checkpoint = root / "ImageReward.pt"
    torch.save(model.state_dict(), checkpoint)
    return checkpoint, tokenizer_dir, model


def release_scores(model, images_uint8, prompts):
    """`ImageReward.score(prompt, PIL image)` of each pair, with the image encoder's output
    and the MLP's input (the text feature) caught on the way: three numpy arrays."""
    import numpy as np
    import torch
    from PIL import Image

    caught = {"image": [], "text": []}
    hooks = [
        model.blip.visual_encoder.register_forward_hook(
            lambda m, i, o: caught["image"].append(o.detach().numpy()[0])
        ),
        model.mlp.register_forward_hook(
            lambda m, i, o: caught["text"].append(i[0].detach().numpy()[0])
        ),
    ]
    try:
        with torch.no_grad():
            scores = [
                model.score(p, Image.fromarray(np.asarray(x)))
                for x, p in zip(images_uint8, prompts)
            ]
    finally:
        for hook in hooks:
            hook.remove()
    return np.asarray(scores), np.stack(caught["image"]), np.stack(caught["text"])
