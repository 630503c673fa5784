"""The training configuration: pydantic models, frozen, unknown keys rejected.

``TrainingConfig`` is here; the models of its nested parts are in ``dataset_sections.py`` (datasets)
and ``sections.py`` (caches, GH200 options, augmentations, LyCORIS options), importable from here too. Every field
carries a description; ``documentation/CONFIG.md`` is generated from these models
(``python -m simpletuner.configuration.docs``) and a test keeps the two in step. The rules between
fields are in ``rules.py``, the model families in ``families.py``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from simpletuner.configuration.alloc_conf import allocator_settings_problems
from simpletuner.configuration.dataset_sections import (
    DatasetConfig,
    InMemoryDatasetConfig,
    InMemoryOptions,
    LocalDatasetConfig,
)
from simpletuner.configuration.families import FAMILY_NAMES, FAMILY_ONLY_KEYS
from simpletuner.configuration.optimizer_settings import parse_optimizer_config
from simpletuner.configuration.prompts import merged_prompts, prompts_from
from simpletuner.configuration.rules import TRAINING_RULES, Rule, check_rules, validation_sizes
from simpletuner.configuration.sections import (
    MAX_LEARNING_RATE,
    MAX_RESOLUTION,
    Augmentations,
    CacheConfig,
    FolderName,
    GH200Optimizations,
    LycorisOptions,
    PathText,
    _Strict,
)

__all__ = [
    "Augmentations",
    "CacheConfig",
    "DatasetConfig",
    "GH200Optimizations",
    "InMemoryDatasetConfig",
    "InMemoryOptions",
    "LocalDatasetConfig",
    "LycorisOptions",
    "TrainingConfig",
]


class TrainingConfig(_Strict):
    """One training run. Load it with ``simpletuner.configuration.load_config``."""

    cross_field_rules: ClassVar[tuple[Rule, ...]] = TRAINING_RULES

    # --- model ---
    pretrained_model_name_or_path: PathText = Field(
        ...,
        min_length=1,
        description=(
            "Local diffusers-format folder (or a hub id where the machine has network). A relative path is taken "
            "from the config file's folder, as every path in the config; a relative `org/name` that is not a folder "
            "there stays a hub id."
        ),
    )
    model_family: Literal[FAMILY_NAMES] = Field(
        None,
        validate_default=True,
        description=(
            "Omit it to take the family from the model folder's `model_index.json` (`_class_name`: "
            "`StableDiffusionPipeline` -> `sd`, `StableDiffusionXLPipeline` -> `sdxl`, `StableDiffusion3Pipeline` -> "
            "`sd3`, `FluxPipeline` -> `flux`, `WanPipeline` -> `wan`, `QwenImagePipeline` -> `qwen_image`; the "
            "start-up log says where it came from); "
            "omitted with a hub id (no local folder): `sd`. Set, it must agree with a local folder's pipeline class, "
            "or the config is refused before any data is read. Model family: `sd` (Stable Diffusion 1.x/2.x UNet), "
            "`sdxl` (Stable Diffusion XL: two CLIP text encoders, pooled embeds; its size/crop time ids are each "
            "image's size before resizing and its crop offset, as in diffusers' SDXL training script), `sd3` (Stable "
            "Diffusion 3 MMDiT, flow matching: two CLIP encoders and T5 where present), `flux` (Flux.1 transformer, "
            "flow matching with guidance embedding and packed latents: CLIP-L pooled + T5), `wan` (Wan 2.1 / 2.2 "
            "text-to-video transformer, flow matching, UMT5 text encoder; image datasets train as 1-frame video; a "
            "Wan 2.2 folder holds two experts, `transformer` for high noise and `transformer_2` for low noise, split "
            "at the pipeline's `boundary_ratio`), `qwen_image` (Qwen-Image MMDiT text-to-image, flow matching with "
            "the resolution-dependent shift and 2x2 packed latents, Qwen2.5-VL text encoder)."
        ),
    )
    prediction_type: Optional[Literal["epsilon", "v_prediction"]] = Field(
        None, description="Training target; default: the `prediction_type` of the model's scheduler config."
    )
    t5_max_length: Optional[int] = Field(
        None,
        ge=1,
        le=512,
        description=(
            "sd3: T5 tokens per caption, for training and validation. Unset: 256 (StableDiffusion3Pipeline's "
            "default). SimpleTuner uses 154; diffusers' SD3 LoRA script 77. T5 runs unmasked, so the length "
            "changes every token's embedding."
        ),
    )
    rescale_betas_zero_snr: bool = Field(
        False,
        description=(
            "sd / sdxl: rescale the model scheduler's betas to zero terminal SNR (diffusers' `DDPMScheduler` "
            "option, Lin et al. 2023) for training, and sample validation images with trailing timestep spacing. "
            "Meant for v-prediction models; SimpleTuner turns it on for every SD 2.x model."
        ),
    )
    revision: Optional[str] = Field(None, description="Hub revision, when loading from the hub.")
    base_model_precision: Literal["no_change", "qfloat8", "qint8", "int8_torchao", "fp8_torchao"] = Field(
        "no_change",
        description=(
            "Store the frozen base's Linear weights in 8 bits: `qfloat8` / `qint8` (optimum-quanto, the `quanto` "
            "extra) or `int8_torchao` / `fp8_torchao` (torchao, the `torchao` extra); those weights take about half "
            "their bf16 memory (a quarter of fp32), convolutions and norms keep the mixed-precision dtype; costs a "
            "little quality and, weight-only, some speed. Adapters (LoRA / LyCORIS) still train in fp32; the saved "
            "LoRA loads onto the unquantised base. DoRA (`lora_use_dora`) needs a torchao kind. `no_change`: the "
            "mixed-precision dtype. LoRA / LyCORIS only."
        ),
    )
    train_stages: Literal["both", "high", "low"] = Field(
        "both",
        description=(
            "Wan 2.2 (two experts): `both` trains an adapter on each expert in one run (each sample goes to the "
            "expert its timestep belongs to); `high` / `low` trains only the high-noise (`transformer`, timesteps at "
            "or above the boundary) or low-noise (`transformer_2`) expert, sampling timesteps on its side only."
        ),
    )
    ti2v_first_frame: bool = Field(
        False,
        description=(
            "Wan 2.2 TI2V-5B only: train its image-to-video mode. The first latent frame of each clip stays clean "
            "(timestep 0 on its tokens, the others at the drawn timestep, as WanImageToVideoPipeline with "
            "`expand_timesteps` runs it) and the loss covers the other frames; one-frame samples (images) train "
            "text-to-video. `false`: text-to-video, as WanPipeline runs the model."
        ),
    )
    low_vram: bool = Field(
        False,
        description=(
            "Keep what is idle in CPU RAM: the frozen expert when `train_stages` is `high` or `low`, and the text "
            "encoders and VAE kept for validation; each moves to the GPU only while it is needed (validation). Costs "
            "a host-to-device copy per validation. On unified-memory machines (GH200, GB10) try it off first: "
            "there the GPU reads CPU RAM directly and the copies gain little."
        ),
    )

    # --- output ---
    output_dir: PathText = Field(
        "output",
        description=(
            "Folder for checkpoints, logs, validation images and the final weights. A relative path is taken from the "
            "config file's folder (not the working directory; `--set` values too)."
        ),
    )

    # --- data ---
    datasets: Optional[list[DatasetConfig]] = Field(
        None, description="Dataset entries (see the dataset tables below). Give this or `data_backend_config`."
    )
    data_backend_config: Optional[PathText] = Field(
        None, description="Path to a JSON file holding the list of dataset entries (relative to the config file)."
    )
    resolution: int = Field(
        512,
        gt=0,
        le=MAX_RESOLUTION,
        description=(
            "Training resolution: images are resized so their area is about resolution², then bucketed by aspect. At "
            "most 16384."
        ),
    )
    aspect_bucket_alignment: int = Field(
        64,
        gt=0,
        le=MAX_RESOLUTION,
        description=(
            "Bucket sides are multiples of this. It must be a multiple of the VAE's pixels per latent times the "
            "latents the denoiser takes per token along a side: 8 for sd / sdxl (the VAE's 8; 64 is usual, so "
            "every UNet level divides evenly), 16 for sd3 / wan (2x2 patches) and flux (2x2 packing); refused "
            "otherwise at config time, and checked again against the model folder's own configs before it loads."
        ),
    )
    max_bad_image_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "Unreadable images (empty, cut off, not an image, no permission) are skipped and named in a warning at "
            "the end of the dataset scan and of the cache fill; the run stops when this fraction of a dataset or "
            "more cannot be read (default: half, which usually means a wrong folder or a failed copy). 0: any "
            "unreadable image stops the run. Also the share of a dataset that may need more than 2x upscaling "
            "(`allow_upscale` unset)."
        ),
    )
    cache_config: CacheConfig = Field(
        default_factory=CacheConfig, description="Cache placement; see the cache table below."
    )
    gh200_optimizations: GH200Optimizations = Field(
        default_factory=GH200Optimizations,
        description="Unified-memory hints and the accumulation ramp; see the table below.",
    )

    # --- schedule ---
    train_batch_size: int = Field(1, ge=1, description="Micro-batch size per process.")
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        description=(
            "Micro-batches per optimizer step. Unset: `ACCELERATE_GRADIENT_ACCUMULATION_STEPS` when the launch sets it "
            "(DeepSpeed launches), else 1; both set and different: the run stops, naming both."
        ),
    )
    max_train_steps: Optional[int] = Field(
        None, ge=1, description="Optimizer steps to train. Takes precedence over `num_train_epochs`."
    )
    num_train_epochs: Optional[int] = Field(
        None, ge=1, description="Epochs to train when `max_train_steps` is not set."
    )
    seed: int = Field(
        42, ge=0, le=2**32 - 1, description="Seed for initialisation, data order, noise and timesteps (0 to 2^32 - 1)."
    )

    # --- optimisation ---
    learning_rate: float = Field(1e-4, gt=0, le=MAX_LEARNING_RATE, description="Peak learning rate (at most 1).")
    lr_scheduler: Literal[
        "constant",
        "constant_with_warmup",
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "simpletuner_cosine",
    ] = Field(
        "constant",
        description=(
            "Learning-rate schedule, stepped once per optimizer step. diffusers' `get_scheduler` shapes: "
            "`constant`; `constant_with_warmup`; `linear` (warm-up, then down to 0); `cosine` (warm-up, then half "
            "a cosine down to 0); `cosine_with_restarts` (diffusers' hard restarts, one cycle); `polynomial` "
            "(warm-up, then `(1 - progress) ** lr_power` from `learning_rate` down to `lr_end`). "
            "`simpletuner_cosine`: SimpleTuner's `cosine`, no warm-up ramp: from `learning_rate` down to `lr_end` "
            "and back, a half-period of `lr_warmup_steps` optimizer steps (1000 / processes when it is 0). In a "
            "SimpleTuner config the names mean SimpleTuner's shapes: its `cosine` is `simpletuner_cosine` here, its "
            "`constant` with a warm-up is `constant_with_warmup`, its `polynomial` uses `lr_end` 4e-7 and `lr_power` "
            "0.8 unless set (documentation/MIGRATING_FROM_SIMPLETUNER.md)."
        ),
    )
    lr_warmup_steps: int = Field(
        0,
        ge=0,
        description="Optimizer steps of linear warm-up from 0; `simpletuner_cosine`: its half-period instead.",
    )
    lr_end: Optional[float] = Field(
        None,
        ge=0,
        le=MAX_LEARNING_RATE,
        description=(
            "The lowest learning rate of `polynomial` (unset: diffusers' 1e-7) and `simpletuner_cosine` (unset: "
            "SimpleTuner's 4e-7). Other schedules do not read it: setting it with them stops the run."
        ),
    )
    lr_power: Optional[float] = Field(
        None,
        gt=0,
        description=(
            "The exponent of `polynomial`'s decay (unset: diffusers' 1.0; SimpleTuner's default is 0.8). Other "
            "schedules do not read it: setting it with them stops the run."
        ),
    )
    optimizer: Literal["adamw", "adam", "sgd", "automagic", "adamw_bf16", "prodigy"] = Field(
        "adamw",
        description=(
            "`adamw`, `adam`, `sgd` (torch), or `automagic`: a learning rate per element, starting at "
            "`learning_rate`, raised by `lr_bump` while its update keeps its sign and lowered when it flips, "
            "within [`min_lr`, `max_lr`]; Adafactor-style factored second moments (about 3 bytes of state per "
            "weight instead of AdamW's 8), decoupled weight decay, stochastic rounding into bf16 weights. "
            "`adamw_bf16`: AdamW that keeps bf16 weights and moments in bf16 and rounds each update "
            "stochastically (unbiased, so steps below a bf16 ulp still add up); on fp32 weights (LoRA and "
            "LyCORIS adapters, full fine-tunes here) it is exactly `adamw`. `prodigy`: Prodigy (the `prodigy` "
            "extra, prodigyopt), Adam with a step size `d` it estimates itself; `learning_rate` multiplies `d` and "
            "should be about 1.0; its other settings go in `optimizer_config`, and each param group (each Wan 2.2 "
            "expert) estimates its own `d`."
        ),
    )
    lr_bump: float = Field(
        1e-6, gt=0, le=MAX_LEARNING_RATE, description="Automagic: how much an element's learning rate moves per step."
    )
    min_lr: float = Field(1e-7, gt=0, le=MAX_LEARNING_RATE, description="Automagic: lowest per-element learning rate.")
    max_lr: float = Field(1e-3, gt=0, le=MAX_LEARNING_RATE, description="Automagic: highest per-element learning rate.")
    optimizer_config: dict[str, Union[bool, int, float, str, None]] = Field(
        default_factory=dict,
        description=(
            "The optimizer's own settings: a JSON object, or SimpleTuner's string of comma-separated "
            '`key=value` pairs (`"d_coef=0.5,use_bias_correction=true"`). `sgd` takes `momentum` (default 0.9). '
            "`prodigy` takes `d_coef` "
            "(multiplies the estimate of `d`, default 1.0), `d0` (initial `d`, 1e-6), `growth_rate` (most `d` may "
            "grow per step, unbounded), `beta3` (decay of the `d` statistics, sqrt(`adam_beta2`)), "
            "`use_bias_correction` (false), `safeguard_warmup` (false), `decouple` (decoupled weight decay, true), "
            "`slice_p` (estimate `d` from every p-th element, 1), `split_groups` (one `d` per param group, true). "
            "Learning rate, betas, epsilon and weight decay come from `learning_rate`, `adam_beta1`, `adam_beta2`, "
            "`adam_epsilon` and `weight_decay`."
        ),
    )
    prodigy_steps: int = Field(
        0,
        ge=0,
        description=(
            "Prodigy: steps during which each param group adapts its step size `d`; after them `d` stays fixed "
            "and training goes on at that size. 0: adapt throughout."
        ),
    )
    vae_batch_size: int = Field(
        8,
        ge=1,
        description=(
            "Images (or videos) per VAE call when filling the latent cache and when re-encoding it; lower it if "
            "encoding runs out of memory."
        ),
    )
    high_noise_learning_rate: Optional[float] = Field(
        None,
        gt=0,
        le=MAX_LEARNING_RATE,
        description="Wan 2.2: `learning_rate` of the high-noise expert's adapter (default: `learning_rate`).",
    )
    high_noise_lr_bump: Optional[float] = Field(
        None,
        gt=0,
        le=MAX_LEARNING_RATE,
        description="Wan 2.2, Automagic: `lr_bump` of the high-noise expert (default: `lr_bump`).",
    )
    high_noise_min_lr: Optional[float] = Field(
        None,
        gt=0,
        le=MAX_LEARNING_RATE,
        description="Wan 2.2, Automagic: `min_lr` of the high-noise expert (default: `min_lr`).",
    )
    high_noise_max_lr: Optional[float] = Field(
        None,
        gt=0,
        le=MAX_LEARNING_RATE,
        description="Wan 2.2, Automagic: `max_lr` of the high-noise expert (default: `max_lr`).",
    )
    low_noise_learning_rate: Optional[float] = Field(
        None,
        gt=0,
        le=MAX_LEARNING_RATE,
        description="Wan 2.2: `learning_rate` of the low-noise expert's adapter (default: `learning_rate`).",
    )
    low_noise_lr_bump: Optional[float] = Field(
        None,
        gt=0,
        le=MAX_LEARNING_RATE,
        description="Wan 2.2, Automagic: `lr_bump` of the low-noise expert (default: `lr_bump`).",
    )
    low_noise_min_lr: Optional[float] = Field(
        None,
        gt=0,
        le=MAX_LEARNING_RATE,
        description="Wan 2.2, Automagic: `min_lr` of the low-noise expert (default: `min_lr`).",
    )
    low_noise_max_lr: Optional[float] = Field(
        None,
        gt=0,
        le=MAX_LEARNING_RATE,
        description="Wan 2.2, Automagic: `max_lr` of the low-noise expert (default: `max_lr`).",
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, le=1, description="Adam epsilon.")
    weight_decay: float = Field(1e-2, ge=0, le=1, description="Decoupled weight decay (AdamW) or L2 (Adam/SGD).")
    max_grad_norm: Optional[float] = Field(
        1.0,
        gt=0,
        description="Clip gradients to this (how: `grad_clip_method`) before each optimizer step; null: no clipping.",
    )
    grad_clip_method: Literal["norm", "value"] = Field(
        "norm",
        description=(
            "`norm`: scale all gradients together so their total L2 norm is at most `max_grad_norm`; `value`: clamp "
            "each gradient element to [-`max_grad_norm`, `max_grad_norm`] (SimpleTuner's default)."
        ),
    )
    use_ema: bool = Field(
        False,
        description=(
            "Keep an exponential moving average (EMA) of the trained weights (the adapter's, or the whole denoiser's "
            "in a full fine-tune), updated after each real optimizer step (`ema_update_interval`; a skipped window "
            "does not count). Saved in every checkpoint (`ema.safetensors`, restored exactly on resume) and at the "
            "end as a second set of final weights under `output_dir/ema/` (same file names and format as the "
            "final weights, e.g. `ema/pytorch_lora_weights.safetensors`); `ema_validation` says which weights "
            "validation renders. Costs a copy of the trained weights (on `ema_device`) and an update per step."
        ),
    )
    ema_decay: float = Field(
        0.995,
        ge=0,
        lt=1,
        description=(
            "The EMA's decay: `ema = decay * ema + (1 - decay) * weights`. As in SimpleTuner it ramps up: at "
            "optimizer step `t` the decay used is `min((1 + s) / (10 + s), ema_decay)` with `s = t - 1` (so step 1 "
            "copies the weights), unless `ema_warmup_steps` is set."
        ),
    )
    ema_update_interval: int = Field(
        1,
        ge=1,
        description=(
            "Update the EMA after optimizer steps that are multiples of this (1: every step). The decay still follows "
            "the step number, not the count of updates."
        ),
    )
    ema_warmup_steps: int = Field(
        0,
        ge=0,
        description=(
            "0: the decay ramp of `ema_decay`. N > 0: before optimizer step N the EMA copies the weights (decay 0), "
            "from step N on it uses `ema_decay` unchanged (no ramp)."
        ),
    )
    ema_device: Literal["cpu", "accelerator"] = Field(
        "cpu",
        description=(
            "Where the EMA lives: `cpu` (no GPU memory; each update copies the trained weights to the CPU and "
            "averages there) or `accelerator` (the training GPU: fastest updates, costs GPU memory for one more "
            "copy of the trained weights)."
        ),
    )
    ema_validation: Literal["none", "ema_only", "comparison"] = Field(
        "comparison",
        description=(
            "With `use_ema`, which weights validation renders: `none` (the trained weights only), `ema_only` (the "
            "EMA weights only, under the usual file names), `comparison` (both: the EMA images are saved as "
            "`step_NNNNNN_K_ema.png` and each grid row shows the trained weights' images, then the EMA's). "
            "Without `use_ema` it has no effect."
        ),
    )
    timestep_sampling: Literal["uniform", "logit_normal", "mode"] = Field(
        "uniform",
        description=(
            "How training timesteps (noise levels) are drawn: `uniform`; `logit_normal` (sigmoid of a normal with "
            "`logit_mean`, `logit_std`: more samples mid-schedule); `mode` (SD3's mode sampling, `mode_scale`)."
        ),
    )
    logit_mean: float = Field(
        0.0,
        ge=-10,
        le=10,
        description=(
            "Location of `logit_normal` sampling, with the sign of diffusers' training scripts' `--logit_mean`: the "
            "noise level (sigma, or t / T) is `sigmoid(x)` with x ~ N(-logit_mean, logit_std), so positive: more "
            "low-noise steps (fine detail), negative: more high-noise steps (composition); 0: symmetric. The SD3 "
            "paper's location `m` and SimpleTuner's per-dataset `timestep_sampling_offset` have the opposite sign."
        ),
    )
    logit_std: float = Field(
        1.0, gt=0, le=10, description="Standard deviation of the normal behind `logit_normal` sampling."
    )
    mode_scale: float = Field(
        1.29,
        ge=-1,
        le=1.75,
        description=(
            "Shape of `mode` sampling (SD3's default 1.29); outside [-1, 1.75] the sampled noise levels would leave "
            "(0, 1)."
        ),
    )
    loss_weighting: Literal["none", "min_snr", "sigma_sqrt", "cosmap", "sigma_squared"] = Field(
        "none",
        description=(
            "Per-sample loss weights: `none`; `min_snr` (Min-SNR-gamma: caps the weight of low-noise timesteps at "
            "`snr_gamma`, for DDPM schedules (sd, sdxl); identity, with one warning, where the scheduler has no "
            "alphas_cumprod); flow-matching weights for flow families (sd3, flux, wan, qwen_image): `sigma_sqrt` "
            "(1 / sigma^2, clamped), `cosmap` (SD3's cosine-map weighting) or `sigma_squared` (sigma^2: with "
            "`loss_type` l2 the loss of diffusers' SD3 script at its default `--precondition_outputs 1`; `none` is "
            "the script with 0, and SimpleTuner's loss)."
        ),
    )
    flow_shift: Optional[float] = Field(
        None,
        gt=0,
        le=100,
        description=(
            "Flow-matching resolution shift applied to the sampled noise levels (`shift * s / (1 + (shift - 1) * s)`; "
            "1.0: none). Default (null): the `shift` of the model's scheduler config. Flow families (sd3) only."
        ),
    )
    flux_guidance_mode: Literal["constant", "random-range"] = Field(
        FAMILY_ONLY_KEYS["flux_guidance_mode"][1],
        description=(
            "Flux with a guidance embedding (FLUX.1-dev-like, `guidance_embeds: true`): the embedded guidance each "
            "training sample gets, as SimpleTuner's key: `constant` (`flux_guidance_value` for every sample) or "
            "`random-range` (per sample, uniform in [`flux_guidance_min`, `flux_guidance_max`), drawn from the run's "
            "seeded generator, so a resumed run draws the same). Validation renders with `validation_guidance_scale`. "
            "Other families, and Flux without a guidance embedding (schnell), refuse a value other than the default."
        ),
    )
    flux_guidance_value: float = Field(
        FAMILY_ONLY_KEYS["flux_guidance_value"][1],
        ge=0,
        description=(
            "The embedded guidance of `flux_guidance_mode` `constant`. 1.0 (SimpleTuner's default) keeps the guidance "
            "distillation; diffusers' train_dreambooth_lora_flux.py trains at its `--guidance_scale` default 3.5."
        ),
    )
    flux_guidance_min: float = Field(
        FAMILY_ONLY_KEYS["flux_guidance_min"][1],
        ge=0,
        description="The lowest guidance of `flux_guidance_mode` `random-range` (SimpleTuner's default 0.0).",
    )
    flux_guidance_max: float = Field(
        FAMILY_ONLY_KEYS["flux_guidance_max"][1],
        ge=0,
        description=(
            "The highest guidance of `flux_guidance_mode` `random-range` (SimpleTuner's default 4.0); at least "
            "`flux_guidance_min`."
        ),
    )
    snr_gamma: float = Field(5.0, gt=0, description="The gamma of `min_snr` weighting (5 in the paper).")
    loss_type: Literal["l2", "huber", "smooth_l1"] = Field(
        "l2",
        description=(
            "The per-element loss between prediction and target, averaged per sample before `loss_weighting`: `l2` "
            "(mean squared error); `huber` (pseudo-Huber `2 c (sqrt(d^2 + c^2) - c)`: squared for small errors, "
            "linear for large ones, so outliers pull less); `smooth_l1` (the same curve without the factor c: "
            "`2 (sqrt(d^2 + c^2) - c)`). c is `huber_c`, scheduled over the noise level by `huber_schedule`. "
            "Every family."
        ),
    )
    huber_schedule: Literal["snr", "exponential", "constant"] = Field(
        "snr",
        description=(
            "How the threshold c of `huber` / `smooth_l1` follows the noise level: `snr` "
            "(`(1 - huber_c) / (1 + s)^2 + huber_c`, s the noise-to-signal ratio: near 1 at low noise, `huber_c` at "
            "high noise); `exponential` (1 at the cleanest timestep down to `huber_c` at the noisiest: "
            "`huber_c ** (t / T)`); `constant` (`huber_c`). Unused with `loss_type` `l2`."
        ),
    )
    huber_c: float = Field(
        0.1,
        gt=0,
        description=(
            "The threshold c of `huber` / `smooth_l1` where the loss turns from squared to linear (the value at "
            "the noisiest step under `huber_schedule` `snr` / `exponential`). Unused with `loss_type` `l2`."
        ),
    )
    noise_offset: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "Offset noise for DDPM families (sd, sdxl): adds `noise_offset` times one normal draw per sample and "
            "channel, constant over the image, to the training noise, so the model can learn very dark or very "
            "light images (typical 0.05-0.1). 0: off. Flow-matching families refuse it."
        ),
    )
    noise_offset_probability: float = Field(
        0.25,
        ge=0,
        le=1,
        description=(
            "The share of micro-batches that get the `noise_offset` (one draw per micro-batch decides; 1: every "
            "one). Unused while `noise_offset` is 0."
        ),
    )
    mixed_precision: Literal["no", "fp16", "bf16"] = Field(
        "no",
        description=(
            "Autocast precision for the forward pass. Unset: what `accelerate launch` was asked for "
            "(`--mixed_precision`, "
            "its `--config_file` or default config file, or `ACCELERATE_MIXED_PRECISION`), else `no`. Set here and in "
            "the launch to different values: the run stops before loading anything, naming both. The precision in "
            "force and its source are logged at start."
        ),
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory, ~30% more compute."
    )
    caption_dropout_probability: float = Field(
        0.0,
        ge=0,
        lt=1,
        description=(
            "Chance that a training sample's caption is replaced by the empty prompt, an empty string (its embedding, "
            "cached like any caption), so the model also learns the unconditional prediction classifier-free "
            "guidance needs (0.1 is usual). Decided per sample from `seed`, the step and the sample, so a resumed "
            "run drops the same captions. Validation and evaluation batches are never dropped. 0: off."
        ),
    )

    # --- adapter ---
    training_type: Literal["lora", "full"] = Field(
        "lora",
        description=(
            "`lora`: train an adapter on the denoiser (`lora_type` says which); `full`: train every denoiser weight."
        ),
    )
    lora_type: Literal["standard", "lycoris"] = Field(
        "standard",
        description=(
            "`standard`: a peft LoRA (optionally DoRA), saved for diffusers' `load_lora_weights`; `lycoris`: a "
            "LyCORIS adapter (`lycoris` table; the `lycoris` extra), saved in LyCORIS' own format."
        ),
    )
    lycoris: LycorisOptions = Field(
        default_factory=LycorisOptions,
        description="LyCORIS options; see the table below. Rank and alpha come from `lora_rank` / `lora_alpha`.",
    )
    lora_rank: int = Field(16, ge=1, description="LoRA rank.")
    lora_alpha: Optional[float] = Field(None, gt=0, description="LoRA alpha; default: equal to `lora_rank` (scale 1).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA path.")
    lora_use_dora: bool = Field(
        False,
        description=(
            "DoRA: also learn a magnitude per output channel (peft `use_dora`); often closer to a full fine-tune at "
            "the same rank; each step costs more (a weight norm per adapted layer)."
        ),
    )
    lora_target_modules: Optional[list[str]] = Field(
        None, description="Module names to adapt; default: the family's attention projections."
    )

    # --- faults ---
    nonfinite_policy: Literal["stop", "skip"] = Field(
        "stop",
        description=(
            "A window whose loss or gradient is NaN/inf never reaches the optimizer. `stop`: save the last good "
            "state and stop with an explanation (exit code 3). `skip`: drop that window and go on (the scheduler and "
            "the ramp do not advance), stopping after `max_consecutive_nonfinite` in a row."
        ),
    )
    max_consecutive_nonfinite: int = Field(
        5, ge=1, description="With `nonfinite_policy: skip`, stop after this many non-finite windows in a row."
    )

    # --- checkpoints ---
    checkpointing_steps: Optional[int] = Field(
        None, ge=1, description="Save a resumable checkpoint every N optimizer steps."
    )
    checkpoints_total_limit: Optional[int] = Field(
        None, ge=1, description="Keep at most this many checkpoints (oldest removed after a new one is complete)."
    )
    checkpoint_at_end: bool = Field(
        True,
        description=(
            "Also save a resumable checkpoint at the run's last step (unless checkpointing_steps already did), so "
            "raising max_train_steps with resume_from_checkpoint 'latest' continues from the end instead of "
            "re-training the tail. false: only the final adapter is written at the end."
        ),
    )
    resume_from_checkpoint: Optional[PathText] = Field(
        None,
        description=(
            "`latest`, or a checkpoint folder to resume from. A relative path is taken from the config file's folder "
            "(not the working directory; `--set` values too)."
        ),
    )

    # --- validation ---
    validation_prompt: Optional[str] = Field(
        None,
        description="Prompt for validation images; with neither it nor `validation_prompts` there is no validation.",
    )
    validation_prompts: Optional[Union[list[str], str]] = Field(
        None,
        description=(
            "Several validation prompts: a list of strings, or the path of a UTF-8 text file with one prompt per line "
            "(blank lines skipped; a relative path is taken from the config file's folder). With `validation_prompt` "
            "as well, both are used: `validation_prompt` first, then these; a prompt given twice is rendered once. "
            "Each validation writes every image (`validation/step_NNNNNN_K.png`, K counting prompt by prompt) and "
            "one grid, `validation/step_NNNNNN_grid.png`: a row per prompt, `num_validation_images` columns."
        ),
    )
    validation_steps: Optional[int] = Field(
        None, ge=1, description="Generate validation images every N optimizer steps (and at the start and end)."
    )
    num_validation_images: int = Field(
        1,
        ge=1,
        description=(
            "Images per prompt at each validation (the columns of the grid); every prompt's images start from the "
            "same seed (`seed`)."
        ),
    )
    validation_num_inference_steps: int = Field(20, ge=1, description="Sampler steps for validation images.")
    validation_guidance_scale: float = Field(
        7.5, ge=0, description="Classifier-free guidance scale for validation images."
    )
    validation_resolution: Optional[Union[int, str]] = Field(
        None,
        description=(
            'Size of the validation images: a number (`1024`: square), `"WIDTHxHEIGHT"` (`"832x480"`), or several '
            'of those separated by commas (`"1024, 832x480"`): each size renders every prompt. Each side must be a '
            "multiple of the family's latent grid (8 for sd / sdxl, 16 for sd3 / flux / wan). Unset: `resolution` "
            "square. With one size the files are named as without this key; with several, each size gets its own "
            "images and grid, named `step_NNNNNN_WxH_K.png` and `step_NNNNNN_WxH_grid.png`."
        ),
    )
    validation_negative_prompt: Optional[str] = Field(
        None,
        description=(
            "Negative prompt for validation images (used where classifier-free guidance is on, "
            "`validation_guidance_scale` > 1). Unset: none. Flux's guidance-distilled sampling uses no negative "
            "prompt: there it is ignored, with a warning."
        ),
    )
    validation_image: Optional[Union[list[PathText], PathText]] = Field(
        None,
        description=(
            "Image families conditioned on an image (Qwen-Image-Edit: the source image to edit; Wan 2.2 I2V / "
            "TI2V with `ti2v_first_frame`: the first frame): one image file for every validation prompt, or a list "
            "with one per prompt, in the order of `validation_prompt_list`. A relative path is taken from the config "
            "file's folder. Unset: an edit model renders from the source image of the first training pair "
            "(said once in the log); an image-to-video model from a flat mid-grey frame. A model that takes no "
            "image refuses the key."
        ),
    )
    validation_seed: Optional[int] = Field(
        None,
        ge=0,
        le=2**32 - 1,
        description=(
            "Seed of every validation prompt's noise (each validation starts every prompt from it, so steps differ "
            "only by the training in between). Unset: `seed`."
        ),
    )
    validation_guidance_rescale: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "Guidance rescale (the `guidance_rescale` of diffusers' SD / SDXL pipelines: blends the guided "
            "prediction toward its rescaled standard deviation, against over-exposure with v-prediction and "
            "zero-terminal-SNR models); 0 turns it off. Only sd and sdxl have it; another family refuses a "
            "non-zero value."
        ),
    )
    validation_num_video_frames: Optional[int] = Field(
        None,
        ge=1,
        description=(
            "Video families (wan): frames per validation video, 4k+1 (1, 5, 9, ..., 81). Unset or 1: one frame, "
            "saved as a PNG as for images. More: the first frame is the PNG (and the grid's tile), and the whole "
            "clip is saved beside it with the PNG's name, at the family's frame rate (wan: 16 fps): "
            "`step_NNNNNN_K.mp4` (H.264; needs PyAV, the `video` extra; an odd side is padded by one pixel), "
            "without PyAV an animated `step_NNNNNN_K.webp` (an animated `.gif` where Pillow cannot write animated "
            "WebP; the log says so once). The clips also go to the trackers as `validation_video`: W&B gets one "
            "video per clip; TensorBoard one clip of them all tiled, which needs moviepy 1.x (`pip install "
            '"moviepy<2"`; without it a warning, once, and TensorBoard keeps the first frames only). Image '
            "families refuse a value other than 1."
        ),
    )

    # --- performance ---
    enable_tf32: bool = Field(
        True,
        description=(
            "Let fp32 matmuls and convolutions use TF32 tensor cores (Ampere and newer): several times faster, "
            "with 10 mantissa bits instead of 23 inside those products. Off: exact fp32. No effect on CPU."
        ),
    )
    enable_compile: bool = Field(
        False,
        description=(
            "`torch.compile` the denoiser: faster steps after a compile that takes tens of seconds to minutes "
            "at start-up and again for each new bucket shape; needs a C compiler on the machine. Unset: on when the "
            "launch asks "
            "for the inductor dynamo backend (`--dynamo_backend inductor`); another backend, or a launch that "
            "disagrees with this key, stops the run."
        ),
    )
    num_cpu_threads: Optional[int] = Field(
        None,
        ge=1,
        le=1024,
        description=(
            "Threads torch uses for CPU work (intra-op; inter-op too where torch still allows it). Unset: a CPU run "
            "(no CUDA device) takes the cores it may use (CPU affinity, cgroup quota) that the 1-minute load "
            "average leaves idle, shared among the run's processes on the machine, at least 1; a CUDA run keeps "
            "torch's default. An `OMP_NUM_THREADS` you set (exported, or `accelerate launch "
            "--num_cpu_threads_per_process`) is used instead of that choice; this key, set, wins over both. The "
            "start-up log says the count, the load and why. Torch's default (one thread per core) on a busy "
            "machine made CPU steps many times slower (documentation/PERFORMANCE.md, CPU threads)."
        ),
    )
    dataloader_num_workers: int = Field(
        0,
        ge=0,
        le=256,
        description=(
            "Threads that read and decode images ahead of the VAE while the latent cache fills (0: decode in the "
            "training process between VAE batches). Helps large datasets at start-up; costs CPU RAM for "
            "two decoded batches per thread. Training steps read from the caches and do not use it, except with "
            "`augmentations_cache_mode` `refresh_each_epoch` or `disable_cache`, which decode while training."
        ),
    )
    dataloader_persistent_workers: bool = Field(
        False,
        description=(
            "Keep the image-decoding threads alive between epochs instead of starting them for each re-encode "
            "(only matters with `augmentations_cache_mode` `refresh_each_epoch` or `disable_cache`)."
        ),
    )
    augmentations: Augmentations = Field(
        default_factory=Augmentations, description="Image augmentations; see the table below."
    )
    augmentations_cache_mode: Literal["disable_cache", "static", "refresh_each_epoch"] = Field(
        "static",
        description=(
            "How augmented images meet the latent cache: `static` encodes one augmented version per image once "
            "(cheapest; the same augmentation every epoch); `refresh_each_epoch` re-encodes every image at the start "
            "of each epoch with new random augmentations (each process its own share, in a folder of its own; old "
            "entries removed; a half-refreshed cache is never read as complete; without augmentations it runs as "
            "`static`); `disable_cache` encodes every batch as it is trained (a VAE pass per step, new augmentations "
            "every time, no latents stored). Both re-encoding modes keep the VAE loaded and decode every image once at "
            "start-up to drop unreadable files."
        ),
    )
    dataloader_pin_memory: bool = Field(
        False,
        description="Pin decoded image batches (CUDA only) so their copy to the GPU is faster; costs page-locked RAM.",
    )
    cuda_allocator: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "PyTorch CUDA caching-allocator settings, written to PYTORCH_CUDA_ALLOC_CONF before CUDA starts "
            "(keys given here win over the environment's). Only keys a stock PyTorch accepts: "
            "`expandable_segments` (less fragmentation with changing shapes), `max_split_size_mb`, "
            "`garbage_collection_threshold`, `roundup_power2_divisions`, `backend`, ...; each value as PyTorch reads "
            "it "
            '(true/false, whole MB, a threshold between 0 and 1, `backend` "native" or "cudaMallocAsync"). Keys of '
            "patched builds (`use_uvm`, `uvm_*`) are refused with what to use instead."
        ),
    )

    # --- logging ---
    logging_steps: int = Field(
        10,
        ge=1,
        description=(
            "Log loss, lr, samples/s, step time, data-wait share and MFU every N optimizer steps (one host sync per "
            "log)."
        ),
    )
    eval_steps: Optional[int] = Field(
        None,
        ge=1,
        description=(
            "Every N optimizer steps, log `eval_loss`: the loss on `eval_iters` fixed micro-batches with fixed "
            "noise and timesteps, without gradients. Comparable across steps, unlike the noisy training loss."
        ),
    )
    eval_iters: int = Field(4, ge=1, description="Micro-batches in each `eval_loss` (more: steadier, slower).")
    report_to: Literal["none", "tensorboard", "wandb"] = Field(
        "none", description="Experiment tracker (through Accelerate)."
    )
    tracker_project_name: FolderName = Field(
        "simpletuner",
        description="Project name for the tracker; also the name of its log folder under `output_dir/logs`.",
    )

    @field_validator("model_family", mode="before")
    @classmethod
    def _family_settled(cls, value: Any) -> Any:
        if value is None:  # the loader fills it from the folder; only a bare model_validate gets here
            raise ValueError(
                "not set, and no model folder was read to take it from: set `model_family` "
                f"({', '.join(FAMILY_NAMES)}), or load the config with simpletuner.configuration.load_config"
            )
        return value

    @field_validator("optimizer_config", mode="before")
    @classmethod
    def _optimizer_config_read(cls, value: Any) -> Any:
        return parse_optimizer_config(value)  # SimpleTuner's "key=value,..." string -> a dict

    @field_validator("cuda_allocator")
    @classmethod
    def _allocator_keys(cls, value: dict) -> dict:
        problems = allocator_settings_problems(value)
        if problems:
            raise ValueError("\n".join(problems))
        return value

    @field_validator("validation_prompts", mode="plain")
    @classmethod
    def _prompts_read(cls, value):
        return prompts_from(value)  # a prompt file's path -> its prompts; one message for any other input

    @model_validator(mode="after")
    def _cross_field(self) -> "TrainingConfig":
        return check_rules(self)  # every rule of rules.TRAINING_RULES, one error listing all problems

    @property
    def effective_lora_alpha(self) -> float:
        return float(self.lora_alpha if self.lora_alpha is not None else self.lora_rank)

    @field_validator("validation_resolution", mode="before")
    @classmethod
    def _validation_sizes_read(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, str, type(None))):
            raise ValueError(f'{value!r} is not a size: give a number (1024), "WIDTHxHEIGHT" or a comma-separated list')
        if value is not None:
            validation_sizes(value)  # raises with what is wrong
        return value

    @property
    def validation_sizes(self) -> list[tuple[int, int]]:
        """The (width, height) of every validation image size, in the order given; one square
        `resolution` when `validation_resolution` is unset."""
        if self.validation_resolution is None:
            return [(self.resolution, self.resolution)]
        return validation_sizes(self.validation_resolution)

    @property
    def validation_prompt_list(self) -> list[str]:
        """Every validation prompt in the order rendered (the grid's rows): `validation_prompt`, then
        `validation_prompts`, each once; empty when the run does no validation."""
        return merged_prompts(self.validation_prompt, self.validation_prompts)
