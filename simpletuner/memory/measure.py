"""Checking the memory estimate against reality, and config-only model folders to estimate from.

:func:`measure_cpu_step` runs one real training step on CPU (tiny models only: it loads the
weights) and measures it with the torch profiler, independently of the estimator's fake-tensor
trace; the tests and ``scripts/bench_estimate.py`` compare the two. :func:`write_config_only_model`
and :func:`write_sd15_config_only` write diffusers-format folders of configs only (real
architectures, no weights): enough for :func:`~simpletuner.memory.estimator.estimate_memory`.

``simpletuner.models`` (diffusers: seconds to import) is imported inside the functions that need
it, as in the estimator.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from simpletuner.memory.estimator import _DTYPES, batch_shapes
from simpletuner.precision import reset_accelerate_state

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig


# --- checking the estimate: a real step on CPU -------------------------------------------------
@dataclass(frozen=True)
class MeasuredStep:
    """Memory of one real training step on CPU, from the profiler's allocation events.

    ``peak``: the most bytes allocated during loss + backward above what was allocated before
    it (parameters, the batch), as ``MemoryBreakdown.backward_peak``; ``activations``: the most
    of that ever live that is not a parameter gradient, as ``MemoryBreakdown.activations``.
    """

    peak: int
    activations: int


def measure_cpu_step(config: "TrainingConfig", batch_size: int | None = None, seed: int = 0) -> MeasuredStep:
    """Run one real training step of ``config`` on CPU and measure it (loads the weights: tiny
    models only). Independent of the estimate: real tensors and weights, the trainer's own
    setup (``load_denoiser``, ``prepare_for_training``, ``Accelerator.prepare`` for mixed precision) and
    the CPU allocator's own accounting as the torch profiler records it, not MemTracker."""
    from accelerate import Accelerator
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    from simpletuner.models import get_model_spec

    batch_size = batch_size or config.train_batch_size
    spec = get_model_spec(config)
    weight_dtype = _DTYPES[config.mixed_precision]
    model = spec.load_denoiser(weight_dtype if config.training_type == "lora" else torch.float32)
    model = spec.prepare_denoiser(model, weight_dtype)
    generator = torch.Generator().manual_seed(seed)
    latent_shape, cond_shapes = batch_shapes(config, batch_size)
    latents = torch.randn(latent_shape.shape, generator=generator).to(latent_shape.dtype)
    conditioning = {k: torch.randn(s.shape, generator=generator).to(s.dtype) for k, s in cond_shapes.items()}
    spec.load_noise_scheduler()
    reset_accelerate_state()
    try:
        accelerator = Accelerator(cpu=True, mixed_precision=config.mixed_precision)
        prepared = accelerator.prepare(model)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            per_sample = spec.training_loss(prepared, latents, conditioning, generator)
            accelerator.backward(per_sample.sum() / batch_size)
    finally:
        reset_accelerate_state()

    events = []  # (time, ptr, signed bytes, allocator total after the event)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.typed[0] == _EventType.Allocation:
            fields = event.typed[1]
            events.append((event.start_time_ns, fields.ptr, fields.alloc_size, fields.total_allocated))
        stack.extend(event.children)
    events.sort(key=lambda e: e[0])
    before = events[0][3] - events[0][2]
    # A gradient's buffer is the last allocation at its storage's address (never freed since).
    grad_ptrs = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    grad_allocs = {ptr: i for i, (_, ptr, size, _) in enumerate(events) if size > 0 and ptr in grad_ptrs}
    grad_at = {i: events[i][2] for i in grad_allocs.values()}
    peak = activations = gradients = 0
    for i, (_, _, _, total) in enumerate(events):
        gradients += grad_at.get(i, 0)
        peak = max(peak, total - before)
        activations = max(activations, total - before - gradients)
    return MeasuredStep(peak=peak, activations=activations)


# --- config-only model folders ---------------------------------------------------------------
#: Stable Diffusion 1.5's architecture: UNet (860M), VAE (f8, 4 latent channels), CLIP ViT-L/14 text.
SD15_UNET = dict(
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
SD15_VAE = dict(
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
SD15_TEXT = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    projection_dim=768,
    hidden_act="quick_gelu",
)
SD15_SCHEDULER = dict(
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
QWEN_IMAGE_TRANSFORMER = dict(
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
QWEN_IMAGE_VAE = dict(
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
)
QWEN_IMAGE_TEXT = dict(
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


#: Qwen2.5-VL's image processor as Qwen-Image-Edit ships it (patch 14, 2x2 merge: a token per 28 x 28 px, between
#: 4 and 16384 image tokens).
QWEN_EDIT_PROCESSOR = dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12845056)


def write_qwen_image_edit_config_only(out_dir: str | Path) -> Path:
    """Qwen-Image-Edit as a config-only folder: Qwen-Image's parts (:func:`write_qwen_image_config_only`), a
    ``QwenImageEditPipeline`` index and the processor's ``preprocessor_config.json`` (its image-token count
    sets the prompt length the estimate counts)."""
    out = write_qwen_image_config_only(out_dir)
    index = json.loads((out / "model_index.json").read_text())
    index.update(_class_name="QwenImageEditPipeline", processor=["transformers", "Qwen2VLProcessor"])
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    (out / "processor").mkdir(exist_ok=True)
    preprocessor = dict(QWEN_EDIT_PROCESSOR, image_processor_type="Qwen2VLImageProcessor")
    (out / "processor" / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return out


#: Wan 2.2's released transformers (Wan-AI/Wan2.2-I2V-A14B-Diffusers, each expert; and
#: Wan-AI/Wan2.2-TI2V-5B-Diffusers), the UMT5-XXL text encoder both use, and their VAEs: the Wan 2.1
#: VAE (16 channels, /8) for A14B, the Wan 2.2 VAE (48 channels, 2x2 patchified, /16) for TI2V-5B.
WAN22_I2V_A14B_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=36,  # 16 noisy + 4 mask + 16 condition latents
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    rope_max_seq_len=1024,
)
WAN22_I2V_BOUNDARY_RATIO = 0.9
WAN22_TI2V_5B_TRANSFORMER = dict(
    WAN22_I2V_A14B_TRANSFORMER, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336, num_layers=30
)
WAN_UMT5_XXL = dict(
    vocab_size=256384,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    feed_forward_proj="gated-gelu",
    dense_act_fn="gelu_new",
    is_gated_act=True,
)
WAN21_VAE = dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]
)
WAN22_VAE = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    temperal_downsample=[False, True, True],
    in_channels=12,
    out_channels=12,
    is_residual=True,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
    # The released per-channel statistics are not needed for an estimate: placeholders of the right length.
    latents_mean=[0.0] * 48,
    latents_std=[1.0] * 48,
)


def _wan_config_only(out_dir, pipeline_class: str, transformers: dict, vae_config: dict, **index_extra) -> Path:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config

    with torch.device("meta"):
        components: dict[str, Any] = {name: WanTransformer3DModel(**cfg) for name, cfg in transformers.items()}
        components["vae"] = AutoencoderKLWan(**vae_config)
    components["text_encoder"] = UMT5Config(**WAN_UMT5_XXL, architectures=["UMT5EncoderModel"])
    components["scheduler"] = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=5.0
    )
    out = write_config_only_model(out_dir, pipeline_class, components)
    index = json.loads((out / "model_index.json").read_text())
    index.update(index_extra)
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out


def write_wan22_i2v_config_only(out_dir: str | Path) -> Path:
    """Wan 2.2 I2V A14B's architecture (two 14B experts, boundary 0.9) as a config-only folder."""
    experts = {"transformer": WAN22_I2V_A14B_TRANSFORMER, "transformer_2": WAN22_I2V_A14B_TRANSFORMER}
    return _wan_config_only(
        out_dir, "WanImageToVideoPipeline", experts, WAN21_VAE, boundary_ratio=WAN22_I2V_BOUNDARY_RATIO
    )


def write_wan22_ti2v_config_only(out_dir: str | Path) -> Path:
    """Wan 2.2 TI2V-5B's architecture (one 5B transformer, the /16 VAE) as a config-only folder."""
    return _wan_config_only(
        out_dir,
        "WanPipeline",
        {"transformer": WAN22_TI2V_5B_TRANSFORMER},
        WAN22_VAE,
        transformer_2=[None, None],
        boundary_ratio=None,
        expand_timesteps=True,
    )
