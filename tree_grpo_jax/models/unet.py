"""The conditional UNet of Stable Diffusion 1.x/2.x in Flax, built from `unet_layers`.

`UNet2DConditionModel` maps (noisy sample [B, C, H, W], timesteps [B], text [B, L, D]) to the
prediction [B, C, H, W]: a timestep embedding, down blocks (resnets with spatial transformers
that cross-attend to the text, then a 2x downsample), a mid block, up blocks that take the
down path's outputs as skips, and an output convolution.

Its defaults compute what diffusers' PyTorch UNet computes (the numerics SD was trained
with). `FLAX_NUMERICS` are the two options under which it computes what diffusers' Flax UNet
computes instead (tanh-approximate GELU in GEGLU, transformer GroupNorm eps 1e-5): the tiny
model was trained so. Module and attribute names follow diffusers' Flax UNet, so the parameter
tree is that class's tree (`down_blocks_0/attentions_0/transformer_blocks_0/ff/net_0/proj/
kernel`, ...): weights convert, load and export as they would for it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from tree_grpo_jax.models.base import constrain_rows, remat_mode
from tree_grpo_jax.models.dit_layers import TimestepEmbedding
from tree_grpo_jax.models.unet_layers import (
    NORM_EPS,
    SAVED,
    TRANSFORMER_NORM_EPS,
    DownBlock2D,
    Downsample2D,
    ResnetBlock2D,
    Transformer2D,
    UpBlock2D,
    Upsample2D,
    timestep_sinusoid,
    up_resnet_inputs,
)

# diffusers' Flax UNet: what the tiny model's weights were trained with.
FLAX_NUMERICS = dict(gelu_approximate=True, transformer_norm_eps=1e-5)
# Fields a caller chooses, never read from a config.json.
RUNTIME_OPTIONS = ("gelu_approximate", "transformer_norm_eps")
DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_BLOCKS = ("UNetMidBlock2DCrossAttn", None)


def _transformer(
    block: _AttentionBlock, channels: int, only_cross_attention: bool = False
) -> Transformer2D:
    """The spatial transformer of a block (called in the block's `setup`)."""
    return Transformer2D(
        in_channels=channels,
        n_heads=block.num_attention_heads,
        d_head=channels // block.num_attention_heads,
        depth=block.transformer_layers_per_block,
        use_linear_projection=block.use_linear_projection,
        only_cross_attention=only_cross_attention,
        use_memory_efficient_attention=block.use_memory_efficient_attention,
        split_head_dim=block.split_head_dim,
        gelu_approximate=block.gelu_approximate,
        norm_eps=block.transformer_norm_eps,
        dtype=block.dtype,
    )


def _resnet(block: _AttentionBlock, in_channels: int, out_channels: int) -> ResnetBlock2D:
    return ResnetBlock2D(
        in_channels=in_channels,
        out_channels=out_channels,
        dropout_prob=block.dropout,
        dtype=block.dtype,
    )


class _AttentionBlock(nn.Module):
    """The fields every block with spatial transformers takes, read by `_resnet` and
    `_transformer`."""

    in_channels: int
    dropout: float = 0.0
    num_layers: int = 1
    num_attention_heads: int = 1
    use_linear_projection: bool = False
    use_memory_efficient_attention: bool = False
    split_head_dim: bool = False
    dtype: jnp.dtype = jnp.float32
    transformer_layers_per_block: int = 1
    gelu_approximate: bool = False
    transformer_norm_eps: float = TRANSFORMER_NORM_EPS


class CrossAttnDownBlock2D(_AttentionBlock, kw_only=True):
    """`num_layers` x (resnet, spatial transformer), then an optional 2x downsample."""

    out_channels: int
    add_downsample: bool = True
    only_cross_attention: bool = False

    def setup(self):
        channels = self.out_channels
        self.resnets = [
            _resnet(self, self.in_channels if i == 0 else channels, channels)
            for i in range(self.num_layers)
        ]
        self.attentions = [
            _transformer(self, channels, self.only_cross_attention) for _ in range(self.num_layers)
        ]
        if self.add_downsample:
            self.downsamplers_0 = Downsample2D(channels, dtype=self.dtype)

    def __call__(self, hidden_states, temb, encoder_hidden_states, deterministic=True):
        output_states = ()
        for resnet, attn in zip(self.resnets, self.attentions):
            hidden_states = resnet(hidden_states, temb, deterministic=deterministic)
            hidden_states = attn(hidden_states, encoder_hidden_states, deterministic=deterministic)
            output_states += (hidden_states,)
        if self.add_downsample:
            hidden_states = self.downsamplers_0(hidden_states)
            output_states += (hidden_states,)
        return hidden_states, output_states


class CrossAttnUpBlock2D(_AttentionBlock, kw_only=True):
    """`num_layers` x (concatenate a skip, resnet, spatial transformer), then an optional
    2x upsample."""

    out_channels: int
    prev_output_channel: int
    add_upsample: bool = True
    only_cross_attention: bool = False

    def setup(self):
        channels = self.out_channels
        self.resnets = [_resnet(self, width, channels) for width in up_resnet_inputs(self)]
        self.attentions = [
            _transformer(self, channels, self.only_cross_attention) for _ in range(self.num_layers)
        ]
        if self.add_upsample:
            self.upsamplers_0 = Upsample2D(channels, dtype=self.dtype)

    def __call__(
        self,
        hidden_states,
        res_hidden_states_tuple,
        temb,
        encoder_hidden_states,
        deterministic=True,
    ):
        for resnet, attn in zip(self.resnets, self.attentions):
            skip, res_hidden_states_tuple = (
                res_hidden_states_tuple[-1],
                res_hidden_states_tuple[:-1],
            )
            hidden_states = jnp.concatenate((hidden_states, skip), axis=-1)
            hidden_states = resnet(hidden_states, temb, deterministic=deterministic)
            hidden_states = attn(hidden_states, encoder_hidden_states, deterministic=deterministic)
        if self.add_upsample:
            hidden_states = self.upsamplers_0(hidden_states)
        return hidden_states


class UNetMidBlock2DCrossAttn(_AttentionBlock):
    """A resnet, then `num_layers` x (spatial transformer, resnet), at constant width."""

    def setup(self):
        channels = self.in_channels
        self.resnets = [_resnet(self, channels, channels) for _ in range(self.num_layers + 1)]
        self.attentions = [_transformer(self, channels) for _ in range(self.num_layers)]

    def __call__(self, hidden_states, temb, encoder_hidden_states, deterministic=True):
        hidden_states = self.resnets[0](hidden_states, temb)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            hidden_states = attn(hidden_states, encoder_hidden_states, deterministic=deterministic)
            hidden_states = resnet(hidden_states, temb, deterministic=deterministic)
        return hidden_states


class UNetOutput(NamedTuple):
    sample: jax.Array  # [B, C, H, W], like the input


def _per_block(value, n: int) -> tuple:
    return tuple(value) if isinstance(value, tuple | list) else (value,) * n


class UNet2DConditionModel(nn.Module):
    """SD1.x/2.x's conditional UNet: `(sample [B, C, H, W], timesteps [B], text [B, L, D])
    -> UNetOutput(sample)`. The fields are the diffusers config's, except `num_heads`, the
    attention heads per block (SD1.x configs call it `attention_head_dim`), and the numerics
    and memory options at the end."""

    sample_size: int = 32
    in_channels: int = 4
    out_channels: int = 4
    down_block_types: tuple[str, ...] = (
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    )
    up_block_types: tuple[str, ...] = (
        "UpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
    )
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    only_cross_attention: bool | tuple[bool, ...] = False
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int = 2
    num_heads: int | tuple[int, ...] = 8
    cross_attention_dim: int = 1280
    dropout: float = 0.0
    use_linear_projection: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    transformer_layers_per_block: int | tuple[int, ...] = 1
    use_memory_efficient_attention: bool = False
    split_head_dim: bool = False
    dtype: jnp.dtype = jnp.float32
    # The spatial transformers' GEGLU GELU (False: exact erf) and input GroupNorm eps; the
    # defaults are PyTorch's, `FLAX_NUMERICS` diffusers' Flax UNet's. Not config.json keys.
    gelu_approximate: bool = False
    transformer_norm_eps: float = TRANSFORMER_NORM_EPS
    # model.remat (a `base.REMAT_MODES` name): each down, mid and up block
    # recomputes its forward in the backward pass, so a train step holds one block's
    # activations and the blocks' inputs; "block_save_attention" keeps the attentions'
    # outputs. Not a config.json key.
    remat: str = "none"

    def _block(self, block, deterministic_at: int):
        """`block`'s class, recomputed in the backward pass as `remat` says
        (`deterministic_at`: the position of its `deterministic` argument, self being 0)."""
        mode = remat_mode(self.remat)
        if mode == "none":
            return block
        policy = None
        if mode == "block_save_attention":
            policy = jax.checkpoint_policies.save_only_these_names(SAVED)
        return nn.remat(block, policy=policy, static_argnums=(deterministic_at,))

    def init_weights(self, rng: jax.Array):
        """Random params (the module's own init on a one-sample input)."""
        size = self.sample_size
        sample = jnp.zeros((1, self.in_channels, size, size), jnp.float32)
        timesteps = jnp.ones((1,), jnp.int32)
        text = jnp.zeros((1, 1, self.cross_attention_dim), jnp.float32)
        params_rng, dropout_rng = jax.random.split(rng)
        rngs = {"params": params_rng, "dropout": dropout_rng}
        return self.init(rngs, sample, timesteps, text)["params"]

    def setup(self):
        for where, types, supported in (
            ("down_block_types", self.down_block_types, DOWN_BLOCKS),
            ("up_block_types", self.up_block_types, UP_BLOCKS),
            ("mid_block_type", (self.mid_block_type,), MID_BLOCKS),
        ):
            if any(t not in supported for t in types):
                raise ValueError(f"{where} {types} are not all among {supported}.")
        channels = self.block_out_channels
        n = len(self.down_block_types)
        heads = _per_block(self.num_heads, n)
        cross_only = _per_block(self.only_cross_attention, n)
        depth = _per_block(self.transformer_layers_per_block, n)
        options = dict(
            dropout=self.dropout,
            use_linear_projection=self.use_linear_projection,
            use_memory_efficient_attention=self.use_memory_efficient_attention,
            split_head_dim=self.split_head_dim,
            gelu_approximate=self.gelu_approximate,
            transformer_norm_eps=self.transformer_norm_eps,
            dtype=self.dtype,
        )

        self.conv_in = nn.Conv(
            channels[0], kernel_size=(3, 3), padding=((1, 1), (1, 1)), dtype=self.dtype
        )
        self.time_embedding = TimestepEmbedding(dim=channels[0] * 4, dtype=self.dtype)

        down_blocks, output_channel = [], channels[0]
        for i, block_type in enumerate(self.down_block_types):
            input_channel, output_channel = output_channel, channels[i]
            last = i == len(channels) - 1
            if block_type == "CrossAttnDownBlock2D":
                block = self._block(CrossAttnDownBlock2D, 4)(
                    in_channels=input_channel,
                    out_channels=output_channel,
                    num_layers=self.layers_per_block,
                    transformer_layers_per_block=depth[i],
                    num_attention_heads=heads[i],
                    add_downsample=not last,
                    only_cross_attention=cross_only[i],
                    **options,
                )
            else:
                block = self._block(DownBlock2D, 3)(
                    in_channels=input_channel,
                    out_channels=output_channel,
                    dropout=self.dropout,
                    num_layers=self.layers_per_block,
                    add_downsample=not last,
                    dtype=self.dtype,
                )
            down_blocks.append(block)
        self.down_blocks = down_blocks

        if self.mid_block_type is None:
            self.mid_block = None
        else:
            self.mid_block = self._block(UNetMidBlock2DCrossAttn, 4)(
                in_channels=channels[-1],
                num_attention_heads=heads[-1],
                transformer_layers_per_block=depth[-1],
                **options,
            )

        up_blocks = []
        reversed_channels = list(reversed(channels))
        output_channel = reversed_channels[0]
        for i, block_type in enumerate(self.up_block_types):
            prev_output_channel, output_channel = output_channel, reversed_channels[i]
            input_channel = reversed_channels[min(i + 1, len(channels) - 1)]
            last = i == len(channels) - 1
            if block_type == "CrossAttnUpBlock2D":
                block = self._block(CrossAttnUpBlock2D, 5)(
                    in_channels=input_channel,
                    out_channels=output_channel,
                    prev_output_channel=prev_output_channel,
                    num_layers=self.layers_per_block + 1,
                    transformer_layers_per_block=depth[::-1][i],
                    num_attention_heads=heads[::-1][i],
                    add_upsample=not last,
                    only_cross_attention=cross_only[::-1][i],
                    **options,
                )
            else:
                block = self._block(UpBlock2D, 4)(
                    in_channels=input_channel,
                    out_channels=output_channel,
                    prev_output_channel=prev_output_channel,
                    num_layers=self.layers_per_block + 1,
                    add_upsample=not last,
                    dropout=self.dropout,
                    dtype=self.dtype,
                )
            up_blocks.append(block)
        self.up_blocks = up_blocks

        self.conv_norm_out = nn.GroupNorm(num_groups=32, epsilon=NORM_EPS)
        self.conv_out = nn.Conv(
            self.out_channels, kernel_size=(3, 3), padding=((1, 1), (1, 1)), dtype=self.dtype
        )

    def __call__(self, sample, timesteps, encoder_hidden_states, train: bool = False) -> UNetOutput:
        deterministic = not train
        timesteps = jnp.atleast_1d(jnp.asarray(timesteps))  # a number for all, or [B]
        features = timestep_sinusoid(
            timesteps, self.block_out_channels[0], self.flip_sin_to_cos, self.freq_shift
        )
        temb = self.time_embedding(features)

        # `constrain_rows`: between blocks the activations keep the run's row layout
        sample = constrain_rows(self.conv_in(jnp.transpose(sample, (0, 2, 3, 1))))  # NHWC
        skips = (sample,)
        # (every argument positional: a remat block takes `deterministic` as a static one)
        for block, kind in zip(self.down_blocks, self.down_block_types):
            if kind == "CrossAttnDownBlock2D":
                sample, res = block(sample, temb, encoder_hidden_states, deterministic)
            else:
                sample, res = block(sample, temb, deterministic)
            sample = constrain_rows(sample)
            skips += tuple(constrain_rows(r) for r in res)

        if self.mid_block is not None:
            sample = constrain_rows(
                self.mid_block(sample, temb, encoder_hidden_states, deterministic)
            )

        width = self.layers_per_block + 1
        for block, kind in zip(self.up_blocks, self.up_block_types):
            res, skips = skips[-width:], skips[:-width]
            if kind == "CrossAttnUpBlock2D":
                sample = block(sample, res, temb, encoder_hidden_states, deterministic)
            else:
                sample = block(sample, res, temb, deterministic)
            sample = constrain_rows(sample)

        sample = self.conv_out(nn.silu(self.conv_norm_out(sample)))
        return UNetOutput(sample=jnp.transpose(sample, (0, 3, 1, 2)))


def unet_module(config: dict, dtype=jnp.float32, **options) -> UNet2DConditionModel:
    """The UNet of a diffusers (PyTorch or Flax) UNet config; `options` override fields
    (e.g. `use_memory_efficient_attention=True`). Config fields it does not read are left for
    the loader to check."""
    fields = {f.name for f in dataclasses.fields(UNet2DConditionModel)}
    fields -= {"parent", "name", "dtype", "num_heads", "remat", *RUNTIME_OPTIONS}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in fields}
    # SD1.x's `attention_head_dim` is really the head count (as in diffusers' PyTorch UNet,
    # heads = num_attention_heads or attention_head_dim).
    heads = config.get("num_attention_heads") or config.get("attention_head_dim", 8)
    kwargs["num_heads"] = tuple(heads) if isinstance(heads, list) else heads
    return UNet2DConditionModel(**{**kwargs, **options}, dtype=dtype)
