"""Tiny random-weight diffusers pipelines, written to a folder, so everything runs with no download.

The folders load through the same ``from_pretrained`` code as real checkpoints. Weights are
random (seeded), so outputs are noise; the point is exercising every code path in seconds.
"""

from __future__ import annotations

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
    """A tiny 4-channel AutoencoderKL with the /8 downscale of the SD VAEs."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        latent_channels=4,
        norm_num_groups=8,
        sample_size=TINY_SD_RESOLUTION,
        layers_per_block=1,
        **overrides,
    )


def write_tiny_sd(out_dir: str | Path, prediction_type: str = "epsilon", seed: int = 0) -> Path:
    """Write a tiny SD 1.x-style pipeline (UNet, VAE, CLIP text encoder, tokenizer, DDPM scheduler)."""
    from diffusers import DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    if prediction_type not in ("epsilon", "v_prediction"):
        raise ValueError(f"prediction_type must be epsilon or v_prediction, not {prediction_type!r}")
    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = tiny_clip_tokenizer()
    text_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=32,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    unet = UNet2DConditionModel(
        sample_size=TINY_SD_RESOLUTION // 8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
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
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    if prediction_type not in ("epsilon", "v_prediction"):
        raise ValueError(f"prediction_type must be epsilon or v_prediction, not {prediction_type!r}")
    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_clip_tokenizer()
    hidden_1, hidden_2 = TINY_SDXL_HIDDEN
    unet = UNet2DConditionModel(
        sample_size=TINY_SD_RESOLUTION // 8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=hidden_1 + hidden_2,
        attention_head_dim=8,
        norm_num_groups=8,
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


TINY_MODELS = {"sd": write_tiny_sd, "sdxl": write_tiny_sdxl}


def write_tiny_model(family: str, out_dir: str | Path, **kwargs) -> Path:
    """Write the tiny model of ``family`` into ``out_dir``."""
    try:
        writer = TINY_MODELS[family]
    except KeyError:
        raise ValueError(f"no tiny model for family {family!r}; known: {', '.join(sorted(TINY_MODELS))}") from None
    return writer(out_dir, **kwargs)
