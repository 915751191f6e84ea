"""The tiny random SD1.5, SD3.5, FLUX.1, Wan2.1, Z-Image, Qwen-Image and FLUX.2 architectures, one
table per family.

Each table maps a folder of the pipeline to the keyword arguments of the class it holds
(diffusers' model or scheduler, transformers' text config), and "model_index" to the
pipeline's model_index.json. launch/tiny_folders.py writes these models with numpy, no torch;
the tests' fixtures (tests/sd_fixtures.py, tests/sd3_fixtures.py, tests/flux_fixtures.py,
tests/wan_fixtures.py, tests/zimage_fixtures.py, tests/qwenimage_fixtures.py) build them with
the PyTorch classes; tests/parity/ compares the two builds, so the one table keeps them the
same architecture. Plain data, nothing imported: both the torch-free launcher and the tests
read it. Sequences are tuples (a config.json holds them as lists); the vocabulary sizes and
token ids come from the tokenizers, not from here (but for the decoder families' byte
tokenizers, whose size is fixed).
"""

# ---------------------------------------------------------------------------------------------
# Stable Diffusion 1.5: UNet, VAE, CLIP text encoder, DDIM scheduler.

SD15 = {
    "text_encoder": dict(  # CLIPTextConfig
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=16,
        hidden_act="quick_gelu",
        projection_dim=32,
    ),
    "unet": dict(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=32,
        attention_head_dim=4,  # SD1.x semantics: the number of heads
        norm_num_groups=32,
    ),
    "vae": dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=16,
    ),
    "scheduler": dict(  # Stable Diffusion 1.5's training schedule
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type="epsilon",
    ),
    "model_index": {
        "_class_name": "StableDiffusionPipeline",
        "feature_extractor": [None, None],
        "requires_safety_checker": False,
        "safety_checker": [None, None],
        "scheduler": ["diffusers", "DDIMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    },
}

# ---------------------------------------------------------------------------------------------
# The flow families' shared parts: the 16-channel VAE without quant convs (each family sets
# its sample size and latent statistics), and the CLIP towers' 77-token length and depth.

FLOW_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(32, 32),
    layers_per_block=1,
    latent_channels=16,
    norm_num_groups=32,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
CLIP_77 = dict(max_position_embeddings=77, num_hidden_layers=2, num_attention_heads=4)
T5_BUCKETS = dict(relative_attention_num_buckets=8, relative_attention_max_distance=16)

# ---------------------------------------------------------------------------------------------
# Stable Diffusion 3.5: MMDiT with dual-attention layers, 16-channel VAE, CLIP-L, CLIP-G, T5,
# flow-matching scheduler.

SD35_T5_WIDTH = 128  # the T5's d_model, standing in for SD3's joint_attention_dim 4096
SD35 = {
    # CLIP-L as SD3 ships it: legacy eos_token_id 2 (pooled at the highest id), quick_gelu.
    "text_encoder": dict(
        **CLIP_77,
        hidden_size=32,
        intermediate_size=37,
        projection_dim=16,
        hidden_act="quick_gelu",
        eos_token_id=2,
    ),
    # CLIP-G: pooled at its real eos id (the tokenizer's <|endoftext|>).
    "text_encoder_2": dict(
        **CLIP_77, hidden_size=48, intermediate_size=53, projection_dim=24, hidden_act="gelu"
    ),
    "text_encoder_3": dict(  # T5Config
        d_model=SD35_T5_WIDTH,
        d_kv=16,
        d_ff=72,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        **T5_BUCKETS,
    ),
    "transformer": dict(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=SD35_T5_WIDTH,
        caption_projection_dim=16,
        pooled_projection_dim=16 + 24,  # the CLIP-L and CLIP-G projections, concatenated
        pos_embed_max_size=12,
        dual_attention_layers=(0, 1),
        qk_norm="rms_norm",
    ),
    "vae": dict(**FLOW_VAE, sample_size=16, scaling_factor=1.5305, shift_factor=0.0609),
    "scheduler": dict(num_train_timesteps=1000, shift=3.0),
    "model_index": {
        "_class_name": "StableDiffusion3Pipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_3": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "tokenizer_3": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "image_encoder": [None, None],
        "feature_extractor": [None, None],
    },
}

# ---------------------------------------------------------------------------------------------
# FLUX.1-dev: transformer with guidance embedding, 16-channel VAE, CLIP-L, T5, dynamically
# shifted flow-matching scheduler.

FLUX_T5_WIDTH = 32  # standing in for FLUX's joint_attention_dim 4096
FLUX_CLIP_WIDTH = 24  # standing in for pooled_projection_dim 768
FLUX = {
    # CLIP-L as FLUX ships it: no projection, quick_gelu, legacy eos_token_id 2 (pooled at
    # the highest id).
    "text_encoder": dict(
        **CLIP_77,
        hidden_size=FLUX_CLIP_WIDTH,
        intermediate_size=37,
        hidden_act="quick_gelu",
        eos_token_id=2,
    ),
    "text_encoder_2": dict(  # T5Config
        d_model=FLUX_T5_WIDTH,
        d_kv=8,
        d_ff=40,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        **T5_BUCKETS,
    ),
    "transformer": dict(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=FLUX_T5_WIDTH,
        pooled_projection_dim=FLUX_CLIP_WIDTH,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ),
    "vae": dict(**FLOW_VAE, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159),
    "scheduler": dict(  # FLUX.1-dev's scheduler_config.json
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
    ),
    "model_index": {
        "_class_name": "FluxPipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "image_encoder": [None, None],
        "feature_extractor": [None, None],
    },
}

# ---------------------------------------------------------------------------------------------
# Wan2.1 text-to-video: WanTransformer3DModel, the video VAE, umT5, UniPC flow scheduler.

WAN_TEXT_WIDTH = 16  # standing in for Wan2.1's text_dim 4096
WAN_LATENT_CHANNELS = 4  # standing in for its 16
WAN = {
    "text_encoder": dict(  # UMT5Config
        d_model=WAN_TEXT_WIDTH,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        feed_forward_proj="gated-gelu",
        **T5_BUCKETS,
    ),
    "transformer": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=WAN_LATENT_CHANNELS,
        out_channels=WAN_LATENT_CHANNELS,
        text_dim=WAN_TEXT_WIDTH,
        freq_dim=8,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=None,
        added_kv_proj_dim=None,
        rope_max_seq_len=32,
    ),
    # 4 pixels per latent, 4 frames per latent frame (the 4k + 1 rule holds).
    "vae": dict(
        base_dim=8,
        z_dim=WAN_LATENT_CHANNELS,
        dim_mult=(1, 2, 2),
        num_res_blocks=1,
        attn_scales=(),
        temperal_downsample=(True, True),
        dropout=0.0,
        latents_mean=(0.3, -0.2, 0.1, 0.5),
        latents_std=(1.5, 0.8, 2.0, 1.2),
    ),
    "scheduler": dict(  # the release's scheduler_config.json (flow_shift 3: the 480p value)
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=1000,
        flow_shift=3.0,
        solver_order=2,
        final_sigmas_type="zero",
    ),
    "model_index": {
        "_class_name": "WanPipeline",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "boundary_ratio": None,
        "expand_timesteps": False,
    },
}

# Wan2.2-TI2V-5B's layout: Wan2.2's VAE (residual up blocks, 2x2 pixel patches: 4 x 2 = 8
# pixels per latent here, 4 frames per latent frame) and WanPipeline's `expand_timesteps`.
WAN22_LATENT_CHANNELS = 6  # standing in for its 48
WAN22 = {
    **WAN,
    "transformer": dict(
        WAN["transformer"], in_channels=WAN22_LATENT_CHANNELS, out_channels=WAN22_LATENT_CHANNELS
    ),
    "vae": dict(
        base_dim=8,
        decoder_base_dim=12,
        z_dim=WAN22_LATENT_CHANNELS,
        dim_mult=(1, 2, 2),
        num_res_blocks=1,
        attn_scales=(),
        temperal_downsample=(True, True),
        dropout=0.0,
        is_residual=True,
        patch_size=2,
        in_channels=12,
        out_channels=12,
        scale_factor_spatial=8,
        scale_factor_temporal=4,
        latents_mean=(0.3, -0.2, 0.1, 0.5, 0.0, -0.4),
        latents_std=(1.5, 0.8, 2.0, 1.2, 0.6, 1.0),
    ),
    "scheduler": dict(WAN["scheduler"], flow_shift=5.0),  # the release's
    "model_index": {**WAN["model_index"], "expand_timesteps": True},
}

# Wan2.2-T2V-A14B's layout: two experts of one shape (`transformer/` for the high-noise steps,
# `transformer_2/` for the low-noise ones) switching at `boundary_ratio`, Wan2.1's VAE. At
# flow_shift 3 and 4 steps the timesteps are 1000, 900, 750, 500: two steps each side of 875.
WAN22_MOE = {
    **WAN,
    "model_index": {
        **WAN["model_index"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"],
        "boundary_ratio": 0.875,
    },
}

# ---------------------------------------------------------------------------------------------
# The decoder-text families' shared part: Qwen2-style byte-level tokenizers of 259 tokens (the
# 256 bytes, <|endoftext|> and the two chat markers), so a vocabulary of 260.

DECODER_VOCAB = 260

# ---------------------------------------------------------------------------------------------
# Z-Image-Turbo: ZImageTransformer2DModel, FLUX's 16-channel VAE, a Qwen3 text model, the
# flow-matching scheduler at the release's static shift 3.

ZIMAGE_TEXT_WIDTH = 32  # the Qwen3 hidden size, the transformer's cap_feat_dim (2560 released)
ZIMAGE_RESOLUTION = 32  # pixels: the tiny VAE halves a side, so 16x16 latents, 64 patches
ZIMAGE = {
    "text_encoder": dict(  # Qwen3Config
        vocab_size=DECODER_VOCAB,
        hidden_size=ZIMAGE_TEXT_WIDTH,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 300.0},
    ),
    "transformer": dict(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=48,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=ZIMAGE_TEXT_WIDTH,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=(8, 8, 8),
        axes_lens=(128, 16, 16),
    ),
    "vae": dict(
        **FLOW_VAE, sample_size=ZIMAGE_RESOLUTION, scaling_factor=0.3611, shift_factor=0.1159
    ),
    "scheduler": dict(num_train_timesteps=1000, use_dynamic_shifting=False, shift=3.0),
    "model_index": {
        "_class_name": "ZImagePipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3Model"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "ZImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    },
}

# ---------------------------------------------------------------------------------------------
# Qwen-Image: QwenImageTransformer2DModel, the causal VAE (AutoencoderKLQwenImage, 8 pixels a
# latent as released), Qwen2.5-VL (its language model and a vision tower), the flow-matching
# scheduler with the release's dynamic shift and terminal sigma.

QWENIMAGE_TEXT_WIDTH = 32  # the Qwen2.5-VL hidden size, joint_attention_dim (3584 released)
QWENIMAGE_LATENT_CHANNELS = 16
QWENIMAGE_RESOLUTION = 64  # pixels: 8 a latent, so 8x8 latents, 16 packed tokens
QWENIMAGE = {
    "text_encoder": dict(  # Qwen2_5_VLConfig's text_config
        vocab_size=DECODER_VOCAB,
        hidden_size=QWENIMAGE_TEXT_WIDTH,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 700.0, "mrope_section": [1, 1, 2]},
    ),
    "vision": dict(  # Qwen2_5_VLConfig's vision_config
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=QWENIMAGE_TEXT_WIDTH,
        patch_size=2,
        temporal_patch_size=1,
        spatial_merge_size=1,
        window_size=4,
        fullatt_block_indexes=[0],
    ),
    "transformer": dict(
        patch_size=2,
        in_channels=4 * QWENIMAGE_LATENT_CHANNELS,
        out_channels=QWENIMAGE_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=QWENIMAGE_TEXT_WIDTH,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    ),
    "vae": dict(  # AutoencoderKLQwenImage
        base_dim=8,
        z_dim=QWENIMAGE_LATENT_CHANNELS,
        dim_mult=(1, 2, 2, 2),
        num_res_blocks=1,
        temperal_downsample=(False, True, True),
        latents_mean=(
            0.0629,
            -0.0661,
            0.3202,
            0.0525,
            -0.2678,
            0.1808,
            0.652,
            0.4735,
            -0.3519,
            -0.6327,
            -0.3116,
            0.0207,
            -1.1625,
            -0.1094,
            -0.623,
            -0.3661,
        ),  # fmt: skip
        latents_std=(
            2.2264,
            1.5829,
            1.0994,
            1.3454,
            0.5566,
            0.7486,
            1.8412,
            1.7944,
            1.7308,
            1.2674,
            2.4944,
            2.4617,
            1.8711,
            1.8009,
            1.8769,
            1.2778,
        ),  # fmt: skip
    ),
    "scheduler": dict(  # Qwen/Qwen-Image's scheduler_config.json
        num_train_timesteps=1000,
        use_dynamic_shifting=True,
        shift=1.0,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        base_shift=0.5,
        max_shift=0.9,
        shift_terminal=0.02,
        time_shift_type="exponential",
    ),
    "model_index": {
        "_class_name": "QwenImagePipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    },
}

# ---------------------------------------------------------------------------------------------
# FLUX.2: Flux2Transformer2DModel, AutoencoderKLFlux2 (its batch-norm statistics random), the
# flow-matching scheduler FLUX.2's pipelines ship (FLUX.1-dev's), and the text encoder of each
# variant: dev's Mistral 3 (a Mistral language model beside a Pixtral vision tower) and
# klein's Qwen3. Both text models are deep enough for the pipelines' stacked hidden states
# (dev 10, 20, 30; klein 9, 18, 27), three of them side by side as the transformer's text
# width.

FLUX2_TEXT_WIDTH = 32  # the text models' hidden size; the transformer takes 3 * 32
FLUX2_LATENT_CHANNELS = 8  # the VAE's (32 released); the transformer takes 2x2 patches of them
FLUX2_RESOLUTION = 32  # pixels: the tiny VAE halves a side, so 16x16 latents, 8x8 patches
FLUX2_VOCAB = 272  # the byte tokenizer's 259 tokens, dev's five Mistral markers, spare room
_FLUX2_TEXT = dict(
    vocab_size=FLUX2_VOCAB,
    hidden_size=FLUX2_TEXT_WIDTH,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
_FLUX2_TRANSFORMER = dict(
    patch_size=1,
    in_channels=4 * FLUX2_LATENT_CHANNELS,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=3 * FLUX2_TEXT_WIDTH,
    timestep_guidance_channels=32,
    mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4),
    rope_theta=2000,
    eps=1e-6,
)
_FLUX2_VAE = dict(  # AutoencoderKLFlux2
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(32, 32),
    layers_per_block=1,
    latent_channels=FLUX2_LATENT_CHANNELS,
    norm_num_groups=32,
    sample_size=FLUX2_RESOLUTION,
    patch_size=(2, 2),
    batch_norm_eps=1e-4,
)
_FLUX2_SCHEDULER = dict(  # FLUX.1-dev's scheduler_config.json, which FLUX.2's folders carry
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    base_shift=0.5,
    max_shift=1.15,
)
FLUX2 = {  # FLUX.2-dev
    "text_encoder": dict(  # Mistral3Config's text_config
        **_FLUX2_TEXT,
        model_type="mistral",
        num_hidden_layers=31,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 900.0},
    ),
    "vision": dict(  # Mistral3Config's vision_config
        model_type="pixtral",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=8,
        image_size=16,
        patch_size=4,
    ),
    "transformer": dict(**_FLUX2_TRANSFORMER, guidance_embeds=True),
    "vae": _FLUX2_VAE,
    "scheduler": _FLUX2_SCHEDULER,
    "model_index": {
        "_class_name": "Flux2Pipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    },
}
FLUX2_KLEIN = {  # FLUX.2-klein (the step-distilled release)
    "text_encoder": dict(  # Qwen3Config
        **_FLUX2_TEXT,
        num_hidden_layers=28,
        rope_parameters={"rope_type": "default", "rope_theta": 300.0},
    ),
    "transformer": dict(**_FLUX2_TRANSFORMER, guidance_embeds=False),
    "vae": _FLUX2_VAE,
    "scheduler": _FLUX2_SCHEDULER,
    "model_index": {
        "_class_name": "Flux2KleinPipeline",
        "is_distilled": True,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3ForCausalLM"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    },
}
