"""Tiny random-weight diffusers pipelines, written to a folder, so everything runs with no download.

The folders load through the same ``from_pretrained`` code as real checkpoints. Weights are
random (seeded), so outputs are noise; the point is exercising every code path in seconds.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: Resolution and bucket alignment the tiny SD model is built for (VAE /8, UNet /2).
TINY_SD_RESOLUTION = 64
TINY_SD_ALIGNMENT = 16


def tiny_clip_tokenizer(max_length: int = 77):
    """A byte-level CLIP tokenizer built in memory: every byte is a token, no merges, no files."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    for ch in alphabet:  # end-of-word variants: CLIP's BPE marks the last symbol of a word
        vocab[ch + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def _tiny_vae(**overrides):
    """A tiny AutoencoderKL (4 latent channels unless overridden) with the /8 downscale of the SD VAEs."""
    from diffusers import AutoencoderKL

    kwargs = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        latent_channels=4,
        norm_num_groups=8,
        sample_size=TINY_SD_RESOLUTION,
        layers_per_block=1,
    )
    kwargs.update(overrides)
    return AutoencoderKL(**kwargs)


def _tiny_unet(cross_attention_dim: int, **extra):
    """The tiny two-level UNet the sd and sdxl zoo models share (latents 4 x res/8)."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=TINY_SD_RESOLUTION // 8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=8,
        norm_num_groups=8,
        **extra,
    )


def write_tiny_sd(out_dir: str | Path, prediction_type: str = "epsilon", seed: int = 0) -> Path:
    """Write a tiny SD 1.x-style pipeline (UNet, VAE, CLIP text encoder, tokenizer, DDPM scheduler)."""
    from diffusers import DDPMScheduler, StableDiffusionPipeline
    from transformers import CLIPTextModel

    if prediction_type not in ("epsilon", "v_prediction"):
        raise ValueError(f"prediction_type must be epsilon or v_prediction, not {prediction_type!r}")
    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = tiny_clip_tokenizer()
    text_config = _tiny_clip_config(tokenizer, 32, 32)
    unet = _tiny_unet(cross_attention_dim=32)
    vae = _tiny_vae()
    scheduler = DDPMScheduler(
        num_train_timesteps=1000,
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        prediction_type=prediction_type,
        clip_sample=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=CLIPTextModel(text_config),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(out, safe_serialization=True)
    logger.info("wrote tiny sd pipeline to %s", out)
    return out


#: Tiny SDXL text encoders: widths differ so a swapped or mis-concatenated encoder fails on shape.
TINY_SDXL_HIDDEN = (32, 48)
TINY_SDXL_PROJECTION = 24
TINY_SDXL_TIME_EMBED = 8


def _tiny_clip_config(tokenizer, hidden_size: int, projection_dim: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=projection_dim,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def write_tiny_sdxl(out_dir: str | Path, prediction_type: str = "epsilon", seed: int = 0) -> Path:
    """Write a tiny SDXL-style pipeline: a ``text_time`` UNet, VAE, CLIPTextModel +
    CLIPTextModelWithProjection (two tokenizers) and an Euler scheduler configured like SDXL's.

    The UNet's cross-attention width is the two encoders' hidden sizes summed (SDXL concatenates
    their penultimate hidden states) and its added-embedding input is six time ids times
    ``addition_time_embed_dim`` plus the second encoder's projection (the pooled embedding).
    """
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    if prediction_type not in ("epsilon", "v_prediction"):
        raise ValueError(f"prediction_type must be epsilon or v_prediction, not {prediction_type!r}")
    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_clip_tokenizer()
    hidden_1, hidden_2 = TINY_SDXL_HIDDEN
    unet = _tiny_unet(
        cross_attention_dim=hidden_1 + hidden_2,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=TINY_SDXL_TIME_EMBED,
        projection_class_embeddings_input_dim=6 * TINY_SDXL_TIME_EMBED + TINY_SDXL_PROJECTION,
    )
    vae = _tiny_vae(scaling_factor=0.13025)  # SDXL's VAE scale
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        prediction_type=prediction_type,
        steps_offset=1,
        timestep_spacing="leading",
    )
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=CLIPTextModel(_tiny_clip_config(tokenizer, hidden_1, hidden_1)),
        text_encoder_2=CLIPTextModelWithProjection(_tiny_clip_config(tokenizer_2, hidden_2, TINY_SDXL_PROJECTION)),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )
    pipe.save_pretrained(out, safe_serialization=True)
    logger.info("wrote tiny sdxl pipeline to %s", out)
    return out


#: Tiny SD3 widths: CLIP-L-like and CLIP-G-like hidden sizes and projections, the T5 width
#: (wider than the two CLIP widths summed, as in SD3, so the CLIP features are zero-padded to it).
TINY_SD3_CLIP_HIDDEN = (16, 32)
TINY_SD3_CLIP_PROJECTION = (16, 24)
TINY_SD3_T5_WIDTH = 64
TINY_SD3_LATENT_CHANNELS = 16


def tiny_t5_tokenizer():
    """A unigram T5 tokenizer built in memory: lowercase letters, digits and punctuation, each also
    as a word-initial piece; ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, no sentinel tokens, no files."""
    import string

    from transformers import T5Tokenizer

    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(c, -3.0) for c in chars] + [("\u2581" + c, -2.5) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def write_tiny_sd3(out_dir: str | Path, seed: int = 0, with_t5: bool = True) -> Path:
    """Write a tiny SD3-style pipeline: an SD3Transformer2DModel (MMDiT), a 16-channel VAE with
    SD3's shift and scaling factors, two CLIPTextModelWithProjection of different widths, a T5
    encoder (``with_t5=False``: none, ``model_index.json`` names it null, as SD3 without T5) and
    a FlowMatchEulerDiscreteScheduler with SD3's shift 3.0.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_clip_tokenizer()
    (hidden_1, hidden_2), (proj_1, proj_2) = TINY_SD3_CLIP_HIDDEN, TINY_SD3_CLIP_PROJECTION
    text_encoder_3 = tokenizer_3 = None
    if with_t5:
        tokenizer_3 = tiny_t5_tokenizer()
        t5_config = T5Config(
            vocab_size=len(tokenizer_3),
            d_model=TINY_SD3_T5_WIDTH,
            d_kv=16,
            d_ff=2 * TINY_SD3_T5_WIDTH,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=tokenizer_3.pad_token_id,
            eos_token_id=tokenizer_3.eos_token_id,
            decoder_start_token_id=tokenizer_3.pad_token_id,
        )
        text_encoder_3 = T5EncoderModel(t5_config)
    heads, head_dim = 2, 8
    transformer = SD3Transformer2DModel(
        sample_size=TINY_SD_RESOLUTION // 8,
        patch_size=2,
        in_channels=TINY_SD3_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=TINY_SD3_T5_WIDTH,
        caption_projection_dim=heads * head_dim,
        pooled_projection_dim=proj_1 + proj_2,
        out_channels=TINY_SD3_LATENT_CHANNELS,
        pos_embed_max_size=16,
    )
    vae = _tiny_vae(
        latent_channels=TINY_SD3_LATENT_CHANNELS,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )  # SD3's VAE settings
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae,
        text_encoder=CLIPTextModelWithProjection(_tiny_clip_config(tokenizer, hidden_1, proj_1)),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(_tiny_clip_config(tokenizer_2, hidden_2, proj_2)),
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    pipe.save_pretrained(out, safe_serialization=True)
    logger.info("wrote tiny sd3 pipeline to %s", out)
    return out


TINY_WAN_T5_WIDTH = 32
TINY_WAN_LATENT_CHANNELS = 4


def write_tiny_wan(out_dir: str | Path, seed: int = 0, boundary_ratio: float | None = None) -> Path:
    """Write a tiny Wan 2.1-style pipeline: a one-block WanTransformer3DModel, an AutoencoderKLWan
    with Wan's /8 spatial and /4 temporal factors and 4 latent channels (with their own
    latents_mean / latents_std), a UMT5 encoder with the tiny T5 tokenizer, and the
    UniPCMultistepScheduler (flow prediction, flow_shift 3.0) the Wan checkpoints ship.

    With ``boundary_ratio`` it is a Wan 2.2 A14B-style pipeline: a second expert ``transformer_2``
    (same architecture, its own random weights) for timesteps below ``boundary_ratio * 1000``.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = tiny_t5_tokenizer()
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=TINY_WAN_T5_WIDTH,
            d_kv=8,
            d_ff=2 * TINY_WAN_T5_WIDTH,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )

    def expert():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,  # rope splits 12 as t4 h4 w4
            in_channels=TINY_WAN_LATENT_CHANNELS,
            out_channels=TINY_WAN_LATENT_CHANNELS,
            text_dim=TINY_WAN_T5_WIDTH,
            freq_dim=32,
            ffn_dim=32,
            num_layers=1,
            rope_max_seq_len=32,
        )

    transformer = expert()
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=TINY_WAN_LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, -0.05],
        latents_std=[1.5, 0.8, 2.0, 1.2],
    )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    experts = {} if boundary_ratio is None else {"transformer_2": expert(), "boundary_ratio": boundary_ratio}
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer, **experts
    )
    pipe.save_pretrained(out, safe_serialization=True)
    logger.info("wrote tiny wan%s pipeline to %s", "" if boundary_ratio is None else " 2.2", out)
    return out


#: The Wan 2.2 A14B text-to-video boundary: timesteps >= 875 go to the high-noise expert.
WAN22_T2V_BOUNDARY_RATIO = 0.875


def write_tiny_wan22(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny Wan 2.2-style two-expert pipeline (``model_family: wan``); see :func:`write_tiny_wan`."""
    return write_tiny_wan(out_dir, seed=seed, boundary_ratio=WAN22_T2V_BOUNDARY_RATIO)


#: Tiny Flux widths: CLIP-L-like hidden size (its pooled output is the pooled projection) and T5 width.
TINY_FLUX_CLIP_HIDDEN = 32
TINY_FLUX_T5_WIDTH = 48
TINY_FLUX_LATENT_CHANNELS = 16


def write_tiny_flux(out_dir: str | Path, seed: int = 0, dynamic_shift: bool = True) -> Path:
    """Write a tiny Flux.1-style pipeline: a FluxTransformer2DModel (one double and one single
    block, guidance embedding as Flux dev, 64 packed input channels), a 16-channel VAE with
    Flux's shift and scaling factors, a CLIPTextModel, a T5 encoder and a
    FlowMatchEulerDiscreteScheduler configured as Flux dev's (``dynamic_shift=False``: static shift 3.0).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    t5_config = T5Config(
        vocab_size=len(tokenizer_2),
        d_model=TINY_FLUX_T5_WIDTH,
        d_kv=12,
        d_ff=2 * TINY_FLUX_T5_WIDTH,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id,
        decoder_start_token_id=tokenizer_2.pad_token_id,
    )
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=TINY_FLUX_LATENT_CHANNELS * 4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=TINY_FLUX_T5_WIDTH,
        pooled_projection_dim=TINY_FLUX_CLIP_HIDDEN,
        guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )
    vae = _tiny_vae(
        latent_channels=TINY_FLUX_LATENT_CHANNELS,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )  # Flux's VAE settings
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=dynamic_shift,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=CLIPTextModel(_tiny_clip_config(tokenizer, TINY_FLUX_CLIP_HIDDEN, TINY_FLUX_CLIP_HIDDEN)),
        tokenizer=tokenizer,
        text_encoder_2=T5EncoderModel(t5_config),
        tokenizer_2=tokenizer_2,
    )
    pipe.save_pretrained(out, safe_serialization=True)
    logger.info("wrote tiny flux pipeline to %s", out)
    return out


TINY_MODELS = {
    "sd": write_tiny_sd,
    "sdxl": write_tiny_sdxl,
    "sd3": write_tiny_sd3,
    "flux": write_tiny_flux,
    "wan": write_tiny_wan,
    "wan22": write_tiny_wan22,
}


def write_tiny_model(family: str, out_dir: str | Path, **kwargs) -> Path:
    """Write the tiny model ``family`` (a model family, or ``wan22``: Wan 2.2's two experts) into ``out_dir``."""
    try:
        writer = TINY_MODELS[family]
    except KeyError:
        raise ValueError(f"no tiny model for family {family!r}; known: {', '.join(sorted(TINY_MODELS))}") from None
    return writer(out_dir, **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``simpletuner zoo``'s options."""
    parser.add_argument("--family", default="sd")
    parser.add_argument("--out", required=True)


def run(args: argparse.Namespace) -> int:
    """``simpletuner zoo``: write the tiny pipeline of ``--family`` into ``--out``; returns the exit code."""
    path = write_tiny_model(args.family, args.out)
    print(f"wrote tiny {args.family} pipeline to {path}")
    return 0
