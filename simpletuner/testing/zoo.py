"""Tiny random-weight diffusers pipelines, written to a folder, so everything runs with no download.

The folders load through the same ``from_pretrained`` code as real checkpoints. Weights are
random (seeded), so outputs are noise; the point is exercising every code path in seconds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorKwargs

logger = logging.getLogger(__name__)


def _quiet_model_libraries() -> None:
    """Quiet the model libraries as the trainer does, before the first one loads (no torchao: its probes say
    it is absent); each function that loads one calls this first, so importing the zoo stays light."""
    from simpletuner.models.library_probes import quiet_model_libraries

    quiet_model_libraries()


#: Resolution and bucket alignment the tiny SD model is built for (VAE /8, UNet /2).
TINY_SD_RESOLUTION = 64
TINY_SD_ALIGNMENT = 16


def tiny_clip_tokenizer(max_length: int = 77):
    """A byte-level CLIP tokenizer built in memory: every byte is a token, no merges, no files."""
    _quiet_model_libraries()
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


def _save(pipe, out: Path, label: str) -> Path:
    """Save the diffusers pipeline ``pipe`` into ``out`` (safetensors) and say so. ``pipe`` is unannotated:
    under a type checker diffusers' top-level pipeline names are its dummy objects, which have no methods."""
    pipe.save_pretrained(out, safe_serialization=True)
    logger.info("wrote tiny %s pipeline to %s", label, out)
    return out


def save_sd_pipeline(out: Path, unet, vae, text_encoder, tokenizer, prediction_type: str = "epsilon") -> Path:
    """Save an SD 1.x pipeline folder of these parts with SD 1.5's DDPM schedule (no safety checker)."""
    _quiet_model_libraries()
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    scheduler = DDPMScheduler(
        num_train_timesteps=1000,
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        prediction_type=prediction_type,
        clip_sample=False,
        steps_offset=1,
    )
    parts = dict(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler)
    pipe = StableDiffusionPipeline(**parts, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return _save(pipe, Path(out), "sd")


def write_tiny_sd(out_dir: str | Path, prediction_type: str = "epsilon", seed: int = 0) -> Path:
    """Write a tiny SD 1.x-style pipeline (UNet, VAE, CLIP text encoder, tokenizer, DDPM scheduler)."""
    _quiet_model_libraries()
    import torch
    from transformers import CLIPTextModel

    if prediction_type not in ("epsilon", "v_prediction"):
        raise ValueError(f"prediction_type must be epsilon or v_prediction, not {prediction_type!r}")
    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = tiny_clip_tokenizer()
    text_config = _tiny_clip_config(tokenizer, 32, 32)
    unet = _tiny_unet(cross_attention_dim=32)
    vae = _tiny_vae()
    return save_sd_pipeline(out, unet, vae, CLIPTextModel(text_config), tokenizer, prediction_type)


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
    _quiet_model_libraries()
    import torch
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
    return _save(pipe, out, "sdxl")


#: Tiny SD3 widths: CLIP-L-like and CLIP-G-like hidden sizes and projections, the T5 width
#: (wider than the two CLIP widths summed, as in SD3, so the CLIP features are zero-padded to it).
TINY_SD3_CLIP_HIDDEN = (16, 32)
TINY_SD3_CLIP_PROJECTION = (16, 24)
TINY_SD3_T5_WIDTH = 64
TINY_SD3_LATENT_CHANNELS = 16


def tiny_t5_tokenizer():
    """A unigram T5 tokenizer built in memory: lowercase letters, digits and punctuation, each also
    as a word-initial piece; ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, no sentinel tokens, no files."""
    _quiet_model_libraries()
    import string

    from transformers import T5Tokenizer

    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(c, -3.0) for c in chars] + [("\u2581" + c, -2.5) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def _tiny_t5_config(tokenizer, width: int, d_kv: int, num_layers: int):
    """The config of a tiny T5 encoder (4 heads, 8 position buckets) on ``tokenizer`` (:func:`tiny_t5_tokenizer`)."""
    from transformers import T5Config

    return T5Config(
        vocab_size=len(tokenizer),
        d_model=width,
        d_kv=d_kv,
        d_ff=2 * width,
        num_layers=num_layers,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # T5Config takes it (any config key) and writes it to config.json; transformers 5 leaves it out of the
        # signature it declares
        decoder_start_token_id=tokenizer.pad_token_id,  # type: ignore[call-arg]
    )


def write_tiny_sd3(out_dir: str | Path, seed: int = 0, with_t5: bool = True) -> Path:
    """Write a tiny SD3-style pipeline: an SD3Transformer2DModel (MMDiT), a 16-channel VAE with
    SD3's shift and scaling factors, two CLIPTextModelWithProjection of different widths, a T5
    encoder (``with_t5=False``: none, ``model_index.json`` names it null, as SD3 without T5) and
    a FlowMatchEulerDiscreteScheduler with SD3's shift 3.0.
    """
    _quiet_model_libraries()
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_clip_tokenizer()
    (hidden_1, hidden_2), (proj_1, proj_2) = TINY_SD3_CLIP_HIDDEN, TINY_SD3_CLIP_PROJECTION
    text_encoder_3 = tokenizer_3 = None
    if with_t5:
        tokenizer_3 = tiny_t5_tokenizer()
        text_encoder_3 = T5EncoderModel(_tiny_t5_config(tokenizer_3, TINY_SD3_T5_WIDTH, d_kv=16, num_layers=2))
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
    return _save(pipe, out, "sd3")


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
    _quiet_model_libraries()
    from diffusers import WanPipeline

    out = Path(out_dir)
    tokenizer, text_encoder = _tiny_wan_text(seed)
    z = TINY_WAN_LATENT_CHANNELS
    transformer = _tiny_wan_transformer(z, z)
    vae = _tiny_wan_vae()
    scheduler = _tiny_wan_scheduler()
    experts = (
        {}
        if boundary_ratio is None
        else {"transformer_2": _tiny_wan_transformer(z, z), "boundary_ratio": boundary_ratio}
    )
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer, **experts
    )
    return _save(pipe, out, "wan" if boundary_ratio is None else "wan 2.2")


#: The Wan 2.2 A14B text-to-video boundary: timesteps >= 875 go to the high-noise expert.
WAN22_T2V_BOUNDARY_RATIO = 0.875


def write_tiny_wan22(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny Wan 2.2-style two-expert pipeline (``model_family: wan``); see :func:`write_tiny_wan`."""
    return write_tiny_wan(out_dir, seed=seed, boundary_ratio=WAN22_T2V_BOUNDARY_RATIO)


#: The Wan 2.2 I2V A14B boundary (its model_index.json): timesteps >= 900 go to the high-noise expert.
WAN22_I2V_BOUNDARY_RATIO = 0.9


def _tiny_wan_text(seed: int):
    """The tiny T5 tokenizer and UMT5 encoder of the tiny Wan pipelines (seeded)."""
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = tiny_t5_tokenizer()
    encoder = UMT5EncoderModel(
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
    return tokenizer, encoder


def _tiny_wan_transformer(in_channels: int, out_channels: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=TINY_WAN_T5_WIDTH,
        freq_dim=32,
        ffn_dim=32,
        num_layers=1,
        rope_max_seq_len=32,
    )


def _tiny_wan_vae(**extra):
    """The tiny AutoencoderKLWan: Wan's /8 spatial and /4 temporal factors, its own latents_mean / std;
    ``extra`` changes it (the Wan 2.2 TI2V-style residual, patchified one)."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        **{
            "base_dim": 8,
            "z_dim": TINY_WAN_LATENT_CHANNELS,
            "dim_mult": [1, 1, 1, 1],
            "num_res_blocks": 1,
            "temperal_downsample": [False, True, True],
            "latents_mean": [0.1, -0.2, 0.3, -0.05],
            "latents_std": [1.5, 0.8, 2.0, 1.2],
            **extra,
        }
    )


def _tiny_wan_scheduler():
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )


def write_tiny_wan22_i2v(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny Wan 2.2 I2V A14B-style pipeline (``WanImageToVideoPipeline``, no image encoder):
    two experts whose input is ``z + 4 + z`` channels (noisy latents, the first-frame mask, the
    condition latents) and output ``z``, the tiny Wan VAE, boundary 0.9 as the real folder."""
    _quiet_model_libraries()
    from diffusers import WanImageToVideoPipeline

    out = Path(out_dir)
    tokenizer, text_encoder = _tiny_wan_text(seed)
    z = TINY_WAN_LATENT_CHANNELS
    transformer, transformer_2 = (_tiny_wan_transformer(2 * z + 4, z) for _ in range(2))
    vae = _tiny_wan_vae()
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=_tiny_wan_scheduler(),
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=WAN22_I2V_BOUNDARY_RATIO,
    )
    return _save(pipe, out, "wan 2.2 i2v")


def write_tiny_wan22_ti2v(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny Wan 2.2 TI2V-5B-style pipeline (``WanPipeline`` with ``expand_timesteps``): one
    transformer, and a Wan 2.2-style VAE (residual, 2x2 patchified input, /16 spatially)."""
    _quiet_model_libraries()
    from diffusers import WanPipeline

    out = Path(out_dir)
    tokenizer, text_encoder = _tiny_wan_text(seed)
    z = TINY_WAN_LATENT_CHANNELS
    vae = _tiny_wan_vae(
        decoder_base_dim=8, in_channels=12, out_channels=12, is_residual=True, patch_size=2, scale_factor_spatial=16
    )
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=_tiny_wan_scheduler(),
        transformer=_tiny_wan_transformer(z, z),
        expand_timesteps=True,
    )
    return _save(pipe, out, "wan 2.2 ti2v")


#: Tiny Flux widths: CLIP-L-like hidden size (its pooled output is the pooled projection) and T5 width.
TINY_FLUX_CLIP_HIDDEN = 32
TINY_FLUX_T5_WIDTH = 48
TINY_FLUX_LATENT_CHANNELS = 16


def _tiny_flux_parts(seed: int, dynamic_shift: bool) -> dict:
    """The components of the tiny Flux.1 pipelines, built in this order from the global RNG (seeded here)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    t5_config = _tiny_t5_config(tokenizer_2, TINY_FLUX_T5_WIDTH, d_kv=12, num_layers=1)
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
    return dict(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=CLIPTextModel(_tiny_clip_config(tokenizer, TINY_FLUX_CLIP_HIDDEN, TINY_FLUX_CLIP_HIDDEN)),
        tokenizer=tokenizer,
        text_encoder_2=T5EncoderModel(t5_config),
        tokenizer_2=tokenizer_2,
    )


def write_tiny_flux(out_dir: str | Path, seed: int = 0, dynamic_shift: bool = True) -> Path:
    """Write a tiny Flux.1-style pipeline: a FluxTransformer2DModel (one double and one single
    block, guidance embedding as Flux dev, 64 packed input channels), a 16-channel VAE with
    Flux's shift and scaling factors, a CLIPTextModel, a T5 encoder and a
    FlowMatchEulerDiscreteScheduler configured as Flux dev's (``dynamic_shift=False``: static shift 3.0).
    """
    _quiet_model_libraries()
    from diffusers import FluxPipeline

    return _save(FluxPipeline(**_tiny_flux_parts(seed, dynamic_shift)), Path(out_dir), "flux")


def write_tiny_flux_kontext(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny Flux.1 Kontext pipeline (``FluxKontextPipeline``): the parts of :func:`write_tiny_flux`
    (FLUX.1-Kontext-dev has Flux dev's components, guidance embedding and scheduler)."""
    _quiet_model_libraries()
    from diffusers import FluxKontextPipeline

    return _save(FluxKontextPipeline(**_tiny_flux_parts(seed, True)), Path(out_dir), "flux kontext")


#: The Qwen-Image prompt template's system prefix; the tiny tokenizer learns merges of its words so that it
#: tokenizes to the same 34 tokens as Qwen2.5-VL's (the count the pipeline drops).
_QWEN_TEMPLATE_WORDS = (
    "system user assistant Describe the image by detailing color shape size texture quantity text "
    "spatial relationships of objects and background"
)
#: Tiny Qwen-Image widths: the Qwen2.5-VL text hidden size (the transformer's joint_attention_dim)
#: and the VAE's latent channels (the transformer takes 4x as many packed channels).
TINY_QWEN_TEXT_HIDDEN = 32
TINY_QWEN_LATENT_CHANNELS = 4


def tiny_qwen_tokenizer(words: str = _QWEN_TEMPLATE_WORDS):
    """A byte-level BPE Qwen2 tokenizer built in memory: every byte is a token, plus merges that make
    each of ``words`` (space-separated; by default the Qwen-Image template's) one token, alone and after
    a space (as in Qwen2.5-VL's own vocabulary), and the chat / vision special tokens; no files."""
    _quiet_model_libraries()
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2Tokenizer

    # Learn the merges of the template's words (each alone and after a space) on top of the 256 bytes.
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    pieces = words.split()
    trainer = trainers.BpeTrainer(vocab_size=100_000, initial_alphabet=alphabet, show_progress=False)
    bpe.train_from_iterator(pieces + [" " + w for w in pieces], trainer=trainer)
    learned = json.loads(bpe.to_str())["model"]
    vocab = learned["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
    specials += ["<|image_pad|>", "<|video_pad|>"]
    # transformers declares merges as strings; the BPE model it builds takes only (left, right) pairs
    tokenizer = Qwen2Tokenizer(vocab=dict(vocab), merges=merges, model_max_length=2048)  # type: ignore[arg-type]
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(s, special=True, normalized=False) for s in specials[1:]]}
    )
    return tokenizer


def _tiny_qwen_parts(tokenizer, seed: int) -> dict:
    """The parts every tiny Qwen-Image pipeline shares, built in this order from the global RNG (seeded
    by the caller) and a ``seed`` generator: a two-layer Qwen2_5_VLForConditionalGeneration on
    ``tokenizer`` (with a one-block vision tower), the AutoencoderKLQwenImage, the one-block
    QwenImageTransformer2DModel and Qwen-Image's scheduler. Keyed by the pipelines' component names."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from simpletuner.models.qwen_image import QWEN_IMAGE_SCHEDULER

    ids = tokenizer.convert_tokens_to_ids
    heads, head_dim = 4, TINY_QWEN_TEXT_HIDDEN // 4
    mrope_section = [1, 1, 2]  # the rotary sections of the head: 2 * sum(mrope_section) == head_dim
    assert head_dim == 2 * sum(mrope_section)
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TINY_QWEN_TEXT_HIDDEN,
            "intermediate_size": 2 * TINY_QWEN_TEXT_HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope_section},
            "tie_word_embeddings": True,
            "bos_token_id": tokenizer.pad_token_id,
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": TINY_QWEN_TEXT_HIDDEN,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(seed)
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=TINY_QWEN_LATENT_CHANNELS,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[round(float(x), 4) for x in torch.randn(TINY_QWEN_LATENT_CHANNELS, generator=generator) * 0.5],
        latents_std=[round(float(x), 4) for x in torch.rand(TINY_QWEN_LATENT_CHANNELS, generator=generator) + 0.5],
    )
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=TINY_QWEN_LATENT_CHANNELS * 4,
        out_channels=TINY_QWEN_LATENT_CHANNELS,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=TINY_QWEN_TEXT_HIDDEN,
        axes_dims_rope=(2, 2, 4),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def write_tiny_qwen_image(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny Qwen-Image pipeline (``QwenImagePipeline``): a QwenImageTransformer2DModel (one
    block), an AutoencoderKLQwenImage (video-style, /8, ``TINY_QWEN_LATENT_CHANNELS`` latent channels
    with per-channel latents_mean / latents_std), a two-layer Qwen2_5_VLForConditionalGeneration
    (with a one-block vision tower: the class needs one), the tokenizer of
    :func:`tiny_qwen_tokenizer` and a FlowMatchEulerDiscreteScheduler configured as Qwen-Image's
    (dynamic exponential shift, base 0.5 at 256 tokens to max 0.9 at 8192)."""
    _quiet_model_libraries()
    import torch
    from diffusers import QwenImagePipeline

    out = Path(out_dir)
    torch.manual_seed(seed)
    pipe = QwenImagePipeline(**_tiny_qwen_parts(tiny_qwen_tokenizer(), seed))
    return _save(pipe, out, "qwen_image")


#: The Qwen-Image-Edit template's system prompt, as words and punctuation pieces: with merges for them the
#: tiny tokenizer splits it into the 64 tokens Qwen2.5-VL's does (the count QwenImageEditPipeline drops).
_QWEN_EDIT_TEMPLATE_WORDS = (
    "system user assistant Describe the key features of input image ( color , shape size texture objects "
    "background ), then explain how 's text instruction should alter or modify . Generate a new that meets "
    "requirements while maintaining consistency with original where appropriate"
)
#: The tiny edit model's image processor: transformers' Qwen2VLImageProcessor defaults (patch 14, merge 2,
#: temporal patch 2, min_pixels 56 * 56, max_pixels 28 * 28 * 1280; the released Qwen-Image-Edit
#: processor could not be read here, so these are the library's defaults, not checked against it).
TINY_QWEN_EDIT_PROCESSOR: "Qwen2VLImageProcessorKwargs" = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
}


def write_tiny_qwen_image_edit(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny Qwen-Image-Edit pipeline (``QwenImageEditPipeline``): the parts of
    :func:`write_tiny_qwen_image` (the tokenizer with merges for the edit template's system prompt, so
    it is 64 tokens as in the real tokenizer) and a ``processor`` folder as the released model's: that
    tokenizer and a Qwen2VLImageProcessor configured by :data:`TINY_QWEN_EDIT_PROCESSOR`.

    The processor folder is written from its two parts and named ``["transformers", "Qwen2VLProcessor"]``
    in ``model_index.json``: transformers 5 cannot build a Qwen2VLProcessor without torchvision (its
    video processor needs it), so the pipeline is saved without one and the entry set afterwards."""
    _quiet_model_libraries()
    import json

    import torch
    from diffusers import QwenImageEditPipeline
    from transformers import Qwen2VLImageProcessorPil

    out = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = tiny_qwen_tokenizer(_QWEN_EDIT_TEMPLATE_WORDS)
    pipe = QwenImageEditPipeline(processor=None, **_tiny_qwen_parts(tokenizer, seed))
    _save(pipe, out, "qwen_image edit")
    tokenizer.save_pretrained(out / "processor")
    Qwen2VLImageProcessorPil(**TINY_QWEN_EDIT_PROCESSOR).save_pretrained(out / "processor")
    index_file = out / "model_index.json"
    index = json.loads(index_file.read_text(encoding="utf-8"))
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


TINY_MODELS: dict[str, Callable[..., Path]] = {
    "sd": write_tiny_sd,
    "sdxl": write_tiny_sdxl,
    "sd3": write_tiny_sd3,
    "flux": write_tiny_flux,
    "flux_kontext": write_tiny_flux_kontext,
    "wan": write_tiny_wan,
    "wan22": write_tiny_wan22,
    "wan22_i2v": write_tiny_wan22_i2v,
    "wan22_ti2v": write_tiny_wan22_ti2v,
    "qwen_image": write_tiny_qwen_image,
    "qwen_image_edit": write_tiny_qwen_image_edit,
}


def write_tiny_model(family: str, out_dir: str | Path, **kwargs) -> Path:
    """Write the tiny model ``family`` (a model family, or ``wan22``: Wan 2.2's two experts) into ``out_dir``."""
    try:
        writer = TINY_MODELS[family]
    except KeyError:
        raise ValueError(f"no tiny model for family {family!r}; known: {', '.join(sorted(TINY_MODELS))}") from None
    return writer(out_dir, **kwargs)
