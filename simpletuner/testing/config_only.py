"""Config-only diffusers model folders (real architectures, no weights): enough for
:func:`~simpletuner.memory.estimator.estimate_memory`, so a real-size estimate needs no download.
Used by the tests, ``scripts/bench_estimate.py`` and the figures in documentation/MEMORY.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: Stable Diffusion 1.5's architecture: UNet (860M), VAE (f8, 4 latent channels), CLIP ViT-L/14 text.
SD15_UNET: dict[str, Any] = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768,
    attention_head_dim=8,
    norm_num_groups=32,
)
SD15_VAE: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    layers_per_block=2,
    sample_size=512,
    scaling_factor=0.18215,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
)
SD15_TEXT: dict[str, Any] = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    projection_dim=768,
    hidden_act="quick_gelu",
)
SD15_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    prediction_type="epsilon",
    clip_sample=False,
    steps_offset=1,
)


def write_config_only_model(out_dir: str | Path, pipeline_class: str, components: dict[str, Any]) -> Path:
    """A diffusers-format folder of configs only (no weights): enough for ``estimate_memory``.

    ``components`` maps a pipeline component name to a diffusers model or scheduler instance
    (build models under ``torch.device("meta")``: no memory) or a transformers config; each is
    written with its own ``save_config`` / ``save_pretrained`` and listed in ``model_index.json``.
    """
    import diffusers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"_class_name": pipeline_class, "_diffusers_version": diffusers.__version__}
    for name, obj in components.items():
        if hasattr(obj, "save_config"):  # diffusers ConfigMixin
            obj.save_config(out / name)
            index[name] = ["diffusers", type(obj).__name__]
        else:  # transformers PretrainedConfig: listed as the model class it configures
            obj.save_pretrained(out / name)
            index[name] = ["transformers", (obj.architectures or [type(obj).__name__.replace("Config", "Model")])[0]]
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out


def write_sd15_config_only(out_dir: str | Path) -> Path:
    """SD 1.5's architecture as a config-only folder: estimates without the 4 GB download."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig

    with torch.device("meta"):
        unet, vae = UNet2DConditionModel(**SD15_UNET), AutoencoderKL(**SD15_VAE)
    text = CLIPTextConfig(**SD15_TEXT, architectures=["CLIPTextModel"])
    components = {"unet": unet, "vae": vae, "text_encoder": text, "scheduler": DDPMScheduler(**SD15_SCHEDULER)}
    return write_config_only_model(out_dir, "StableDiffusionPipeline", components)


#: Qwen-Image's released architecture (Qwen/Qwen-Image): the 20B MMDiT transformer (60 blocks,
#: 24 heads x 128, text width 3584, 64 packed input channels), the 16-channel video-style VAE and
#: the Qwen2.5-VL-7B text encoder.
QWEN_IMAGE_TRANSFORMER: dict[str, Any] = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
QWEN_IMAGE_VAE: dict[str, Any] = dict(
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
)
QWEN_IMAGE_TEXT: dict[str, Any] = dict(
    text_config=dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=128000,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    ),
    vision_config=dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14
    ),
)


def write_qwen_image_config_only(out_dir: str | Path) -> Path:
    """Qwen-Image's architecture (20B transformer) as a config-only folder: estimates without the 57 GB download."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig

    from simpletuner.models.qwen_image import QWEN_IMAGE_SCHEDULER

    with torch.device("meta"):
        transformer = QwenImageTransformer2DModel(**QWEN_IMAGE_TRANSFORMER)
        vae = AutoencoderKLQwenImage(**QWEN_IMAGE_VAE)
    text = Qwen2_5_VLConfig(**QWEN_IMAGE_TEXT, architectures=["Qwen2_5_VLForConditionalGeneration"])
    components = {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": text,
        "scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
    }
    return write_config_only_model(out_dir, "QwenImagePipeline", components)
