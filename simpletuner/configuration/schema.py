"""The training configuration: pydantic models, frozen, unknown keys rejected.

``TrainingConfig`` is here; the models of its nested parts are in ``dataset_sections.py`` (datasets)
and ``sections.py`` (caches, GH200 options, augmentations, LyCORIS options), importable from here too. Every field
carries a description; ``documentation/CONFIG.md`` is generated from these models
(``python -m simpletuner.configuration.docs``) and a test keeps the two in step. The rules between
fields are in ``rules.py``, the model families in ``families.py``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union, cast

from pydantic import Field, field_validator, model_validator

from simpletuner.configuration.alloc_conf import allocator_settings_problems
from simpletuner.configuration.dataset_sections import (
    DatasetConfig,
    InMemoryDatasetConfig,
    InMemoryOptions,
    LocalDatasetConfig,
)
from simpletuner.configuration.export_formats import OutputFormat
from simpletuner.configuration.families import FAMILY_NAMES, FAMILY_ONLY_KEYS, FamilyName
from simpletuner.configuration.model_folder import normalise_repo_id, repo_id_problem
from simpletuner.configuration.optimizer_settings import OptimizerName, parse_optimizer_config, with_optimizer_defaults
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
    TreadConfig,
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


def _expert_rate(key: str, expert: str) -> Any:
    """The field of Wan 2.2's ``<expert>_noise_<key>``: ``key`` for that expert alone (unset: ``key``)."""
    if key == "learning_rate":
        what = f"Wan 2.2: `learning_rate` of the {expert}-noise expert's adapter"
    else:
        what = f"Wan 2.2, Automagic: `{key}` of the {expert}-noise expert"
    return Field(default=None, gt=0, le=MAX_LEARNING_RATE, description=f"{what} (default: `{key}`).")


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
    pretrained_vae_model_name_or_path: Optional[PathText] = Field(
        default=None,
        description=(
            "A separate VAE (e.g. `madebyollin/sdxl-vae-fp16-fix` for sdxl, `stabilityai/sd-vae-ft-mse` for sd): a "
            "local folder or a hub id holding it, read from its `vae/` subfolder when it has `vae/config.json`, else "
            "from its root (`config.json` + `diffusion_pytorch_model.safetensors`). Unset: the model's own VAE. A "
            "relative path is taken from the config file's folder, as `pretrained_model_name_or_path`; a hub id "
            "resolves at its default branch (`revision` is the model's). Its VAE class must be one the family loads "
            "and its latent channels the denoiser's; the latent cache is keyed by it, so another VAE re-encodes."
        ),
    )
    controlnet: bool = Field(
        default=False,
        description=(
            "sdxl / flux: train a ControlNet beside the frozen model (`training_type: full`), or a peft LoRA on one "
            "(`lora`), on images paired by file name with conditioning images (each dataset's "
            "`conditioning_data_dir`); validation renders with `validation_image` as the control image. The "
            "ControlNet is `controlnet_model_name_or_path`, else made from the model (`ControlNetModel.from_unet` / "
            "`FluxControlNetModel.from_transformer`: 4 double and 10 single blocks, fewer where the transformer has "
            "fewer) under `seed`. Writes `controlnet/` (the diffusers folder the ControlNet pipelines load; a LoRA "
            'merged in) and, for a LoRA, `pytorch_lora_weights.safetensors` (keys `controlnet.`). See "ControlNet" '
            "in MODEL_FAMILIES.md."
        ),
    )
    controlnet_model_name_or_path: Optional[PathText] = Field(
        default=None,
        description=(
            "With `controlnet`: the ControlNet to train on, a local diffusers folder (its `controlnet/` subfolder "
            "when it has one) or a hub id; relative paths as `pretrained_model_name_or_path`. Unset: a fresh one "
            "made from the model."
        ),
    )
    model_family: FamilyName = Field(
        default=None,
        validate_default=True,
        description=(
            'The model family (see "Model families"). Omitted: read from a local model folder\'s '
            "`model_index.json` (`_class_name`), else `sd`."
        ),
    )
    prediction_type: Optional[Literal["epsilon", "v_prediction"]] = Field(
        default=None, description="Training target; default: the `prediction_type` of the model's scheduler config."
    )
    t5_max_length: Optional[int] = Field(
        default=None,
        ge=1,
        le=512,
        description=(
            "sd3: T5 tokens per caption, for training and validation. Unset: 256 (StableDiffusion3Pipeline's default)."
        ),
    )
    rescale_betas_zero_snr: bool = Field(
        default=False,
        description=(
            "sd / sdxl: rescale the model scheduler's betas to zero terminal SNR (diffusers' `DDPMScheduler` "
            "option, Lin et al. 2023) for training, and sample validation images with trailing timestep spacing."
        ),
    )
    revision: Optional[str] = Field(default=None, description="Hub revision, when loading from the hub.")
    base_model_precision: Literal["no_change", "qfloat8", "qint8", "qint4", "qint2", "int8_torchao", "fp8_torchao"] = (
        Field(
            default="no_change",
            description=(
                "Store the frozen base's Linear weights in fewer bits: `qfloat8` / `qint8` (8 bits), `qint4` / "
                "`qint2` (4 / 2 bits, a scale and shift per group of up to 128 weights) through optimum-quanto (the "
                "`quanto` extra), or `int8_torchao` / `fp8_torchao` (torchao, the `torchao` extra); `no_change`: "
                "the mixed-precision dtype. LoRA / LyCORIS only."
            ),
        )
    )
    train_stages: Literal["both", "high", "low"] = Field(
        default="both",
        description=(
            "Wan 2.2 (two experts): `both` trains an adapter on each expert in one run; `high` / `low` trains "
            "only the high-noise (`transformer`) or low-noise (`transformer_2`) expert."
        ),
    )
    ti2v_first_frame: bool = Field(
        default=False,
        description=(
            "Wan 2.2 TI2V-5B only: train its image-to-video mode, the first latent frame of each clip kept clean. "
            "`false`: text-to-video, as WanPipeline runs the model."
        ),
    )
    low_vram: bool = Field(
        default=False,
        description=(
            "Keep what is idle in CPU RAM (the frozen expert when `train_stages` is `high` or `low`, the text "
            "encoders and VAE kept for validation), each moved to the GPU only while validation needs it. Costs a "
            "host-to-device copy per validation."
        ),
    )

    # --- output ---
    output_dir: PathText = Field(
        default="output",
        description=(
            "Folder for checkpoints, logs, validation images and the final weights. A relative path is taken from the "
            "config file's folder (not the working directory; `--set` values too)."
        ),
    )

    # --- data ---
    datasets: Optional[list[DatasetConfig]] = Field(
        default=None, description="Dataset entries (see the dataset tables below). Give this or `data_backend_config`."
    )
    data_backend_config: Optional[PathText] = Field(
        default=None,
        description="Path to a JSON file holding the list of dataset entries (relative to the config file).",
    )
    resolution: int = Field(
        default=512,
        gt=0,
        le=MAX_RESOLUTION,
        description=(
            "Training resolution: images are resized so their area is about resolution², then bucketed by aspect. At "
            "most 16384. A dataset's own `resolution` overrides it; unset while every dataset sets its own: the "
            "largest of those."
        ),
    )
    aspect_bucket_alignment: int = Field(
        default=64,
        gt=0,
        le=MAX_RESOLUTION,
        description=(
            "Bucket sides are multiples of this. It must be a multiple of the family's latent grid (\"Model "
            'families": 8 for sd / sdxl, 16 for the others), or the config is refused.'
        ),
    )
    max_bad_image_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description=(
            "The share of a dataset that may be unreadable (skipped and named in a warning) before the run stops; "
            "0: any unreadable image stops the run."
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
    train_batch_size: int = Field(default=1, ge=1, description="Micro-batch size per process.")
    gradient_accumulation_steps: int = Field(
        default=1,
        ge=1,
        description=(
            "Micro-batches per optimizer step. Unset: `ACCELERATE_GRADIENT_ACCUMULATION_STEPS` when the launch sets it "
            "(DeepSpeed launches), else 1; both set and different: the run stops, naming both."
        ),
    )
    max_train_steps: Optional[int] = Field(
        default=None, ge=1, description="Optimizer steps to train. Takes precedence over `num_train_epochs`."
    )
    num_train_epochs: Optional[int] = Field(
        default=None, ge=1, description="Epochs to train when `max_train_steps` is not set."
    )
    seed: int = Field(
        default=42,
        ge=0,
        le=2**32 - 1,
        description="Seed for initialisation, data order, noise and timesteps (0 to 2^32 - 1).",
    )

    # --- optimisation ---
    learning_rate: float = Field(
        default=1e-4, gt=0, le=MAX_LEARNING_RATE, description="Peak learning rate (at most 1)."
    )
    lr_scheduler: Literal[
        "constant",
        "constant_with_warmup",
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "simpletuner_cosine",
    ] = Field(
        default="constant",
        description=(
            "Learning-rate schedule, stepped once per optimizer step: diffusers' `get_scheduler` shapes, or "
            "`simpletuner_cosine` (SimpleTuner's `cosine`)."
        ),
    )
    lr_warmup_steps: int = Field(
        default=0,
        ge=0,
        description="Optimizer steps of linear warm-up from 0; `simpletuner_cosine`: its half-period instead.",
    )
    lr_end: Optional[float] = Field(
        default=None,
        ge=0,
        le=MAX_LEARNING_RATE,
        description=(
            "The lowest learning rate of `polynomial` (unset: diffusers' 1e-7) and `simpletuner_cosine` (unset: "
            "SimpleTuner's 4e-7). Other schedules do not read it: setting it with them stops the run."
        ),
    )
    lr_power: Optional[float] = Field(
        default=None,
        gt=0,
        description=(
            "The exponent of `polynomial`'s decay (unset: diffusers' 1.0; SimpleTuner's default is 0.8). Other "
            "schedules do not read it: setting it with them stops the run."
        ),
    )
    optimizer: OptimizerName = Field(
        default="adamw",
        description=(
            "`adamw`, `adam`, `sgd` (torch), `automagic` (a learning rate per element), `adamw_bf16` (AdamW "
            "rounding stochastically into bf16 weights), `prodigy` (prodigyopt's Prodigy, the `prodigy` extra); "
            "under SimpleTuner's names, with its defaults for what the config leaves out: `optimi-adamw`, "
            "`optimi-adam`, `optimi-sgd`, `optimi-lion`, `optimi-stableadamw`, `optimi-radam`, `optimi-ranger`, "
            "`optimi-adan` (torch-optimi, the `optimi` extra), `bnb-adamw8bit`, `bnb-adamw8bit-paged`, "
            "`bnb-lion8bit` (8-bit state, bitsandbytes, the `bitsandbytes` extra) and `torch-adafactor` (torch's "
            "Adafactor). Each one's settings and defaults: `optimizer_config`."
        ),
    )
    lr_bump: float = Field(
        default=1e-6,
        gt=0,
        le=MAX_LEARNING_RATE,
        description="Automagic: how much an element's learning rate moves per step.",
    )
    min_lr: float = Field(
        default=1e-7, gt=0, le=MAX_LEARNING_RATE, description="Automagic: lowest per-element learning rate."
    )
    max_lr: float = Field(
        default=1e-3, gt=0, le=MAX_LEARNING_RATE, description="Automagic: highest per-element learning rate."
    )
    optimizer_config: dict[str, Union[bool, int, float, str, None]] = Field(
        default_factory=dict,
        description=(
            "The optimizer's own settings: a JSON object, or SimpleTuner's string of comma-separated `key=value` "
            'pairs (`"d_coef=0.5,use_bias_correction=true"`). Learning rate, betas, epsilon and weight decay are '
            "top-level keys."
        ),
    )
    prodigy_steps: int = Field(
        default=0,
        ge=0,
        description=(
            "Prodigy: steps during which each param group adapts its step size `d`; after them `d` stays fixed "
            "and training goes on at that size. 0: adapt throughout."
        ),
    )
    vae_batch_size: int = Field(
        default=8,
        ge=1,
        description=(
            "Images (or videos) per VAE call when filling the latent cache and when re-encoding it; lower it if "
            "encoding runs out of memory."
        ),
    )
    high_noise_learning_rate: Optional[float] = _expert_rate("learning_rate", "high")
    high_noise_lr_bump: Optional[float] = _expert_rate("lr_bump", "high")
    high_noise_min_lr: Optional[float] = _expert_rate("min_lr", "high")
    high_noise_max_lr: Optional[float] = _expert_rate("max_lr", "high")
    low_noise_learning_rate: Optional[float] = _expert_rate("learning_rate", "low")
    low_noise_lr_bump: Optional[float] = _expert_rate("lr_bump", "low")
    low_noise_min_lr: Optional[float] = _expert_rate("min_lr", "low")
    low_noise_max_lr: Optional[float] = _expert_rate("max_lr", "low")
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="Adam beta1.")
    adam_beta2: float = Field(default=0.999, ge=0, lt=1, description="Adam beta2.")
    adam_epsilon: float = Field(default=1e-8, gt=0, le=1, description="Adam epsilon.")
    weight_decay: float = Field(
        default=1e-2, ge=0, le=1, description="Decoupled weight decay (AdamW) or L2 (Adam/SGD)."
    )
    max_grad_norm: Optional[float] = Field(
        default=1.0,
        gt=0,
        description="Clip gradients to this (how: `grad_clip_method`) before each optimizer step; null: no clipping.",
    )
    grad_clip_method: Literal["norm", "value"] = Field(
        default="norm",
        description=(
            "`norm`: scale all gradients together so their total L2 norm is at most `max_grad_norm`; `value`: clamp "
            "each gradient element to [-`max_grad_norm`, `max_grad_norm`] (SimpleTuner's default)."
        ),
    )
    use_ema: bool = Field(
        default=False,
        description=(
            "Keep an exponential moving average (EMA) of the trained weights, updated after each real optimizer "
            "step and saved as a second set of final weights under `output_dir/ema/`."
        ),
    )
    ema_decay: float = Field(
        default=0.995,
        ge=0,
        lt=1,
        description=(
            "The EMA's decay: `ema = decay * ema + (1 - decay) * weights`. As in SimpleTuner it ramps up: at "
            "optimizer step `t` the decay used is `min((1 + s) / (10 + s), ema_decay)` with `s = t - 1` (so step 1 "
            "copies the weights), unless `ema_warmup_steps` is set."
        ),
    )
    ema_update_interval: int = Field(
        default=1,
        ge=1,
        description=(
            "Update the EMA after optimizer steps that are multiples of this (1: every step). The decay still follows "
            "the step number, not the count of updates."
        ),
    )
    ema_warmup_steps: int = Field(
        default=0,
        ge=0,
        description=(
            "0: the decay ramp of `ema_decay`. N > 0: before optimizer step N the EMA copies the weights (decay 0), "
            "from step N on it uses `ema_decay` unchanged (no ramp)."
        ),
    )
    ema_device: Literal["cpu", "accelerator"] = Field(
        default="cpu",
        description=(
            "Where the EMA lives: `cpu` (no GPU memory; each update copies the trained weights to the CPU and "
            "averages there) or `accelerator` (the training GPU: fastest updates, costs GPU memory for one more "
            "copy of the trained weights)."
        ),
    )
    ema_validation: Literal["none", "ema_only", "comparison"] = Field(
        default="comparison",
        description=(
            "With `use_ema`, which weights validation renders: `none` (the trained weights only), `ema_only` (the "
            "EMA weights only) or `comparison` (both). Without `use_ema` it has no effect."
        ),
    )
    timestep_sampling: Literal["uniform", "logit_normal", "mode"] = Field(
        default="uniform",
        description=(
            "How training timesteps (noise levels) are drawn: `uniform`; `logit_normal` (sigmoid of a normal with "
            "`logit_mean`, `logit_std`: more samples mid-schedule); `mode` (SD3's mode sampling, `mode_scale`)."
        ),
    )
    logit_mean: float = Field(
        default=0.0,
        ge=-10,
        le=10,
        description=(
            "Location of `logit_normal` sampling, with the sign of diffusers' training scripts' `--logit_mean`: "
            "positive, more low-noise steps (fine detail); negative, more high-noise steps (composition); 0: "
            "symmetric."
        ),
    )
    logit_std: float = Field(
        default=1.0, gt=0, le=10, description="Standard deviation of the normal behind `logit_normal` sampling."
    )
    mode_scale: float = Field(
        default=1.29,
        ge=-1,
        le=1.75,
        description=(
            "Shape of `mode` sampling (SD3's default 1.29); outside [-1, 1.75] the sampled noise levels would leave "
            "(0, 1)."
        ),
    )
    loss_weighting: Literal["none", "min_snr", "sigma_sqrt", "cosmap", "sigma_squared"] = Field(
        default="none",
        description=(
            "Per-sample loss weights: `none`; `min_snr` (Min-SNR-gamma, for DDPM schedules: sd, sdxl); "
            "`sigma_sqrt`, `cosmap` or `sigma_squared` (flow-matching families)."
        ),
    )
    flow_shift: Optional[float] = Field(
        default=None,
        gt=0,
        le=100,
        description=(
            "Flow-matching resolution shift applied to the sampled noise levels (`shift * s / (1 + (shift - 1) * "
            "s)`; 1.0: none; null: the `shift` of the model's scheduler config). Flow families (sd3) only."
        ),
    )
    flux_guidance_mode: Literal["constant", "random-range"] = Field(
        default=FAMILY_ONLY_KEYS["flux_guidance_mode"][1],
        description=(
            "Flux with a guidance embedding: the embedded guidance each training sample gets, `constant` "
            "(`flux_guidance_value`) or `random-range` (per sample, uniform in [`flux_guidance_min`, "
            "`flux_guidance_max`))."
        ),
    )
    flux_guidance_value: float = Field(
        default=FAMILY_ONLY_KEYS["flux_guidance_value"][1],
        ge=0,
        description=(
            "The embedded guidance of `flux_guidance_mode` `constant`. 1.0 (SimpleTuner's default) keeps the guidance "
            "distillation; diffusers' train_dreambooth_lora_flux.py trains at its `--guidance_scale` default 3.5."
        ),
    )
    flux_guidance_min: float = Field(
        default=FAMILY_ONLY_KEYS["flux_guidance_min"][1],
        ge=0,
        description="The lowest guidance of `flux_guidance_mode` `random-range` (SimpleTuner's default 0.0).",
    )
    flux_guidance_max: float = Field(
        default=FAMILY_ONLY_KEYS["flux_guidance_max"][1],
        ge=0,
        description=(
            "The highest guidance of `flux_guidance_mode` `random-range` (SimpleTuner's default 4.0); at least "
            "`flux_guidance_min`."
        ),
    )
    snr_gamma: float = Field(default=5.0, gt=0, description="The gamma of `min_snr` weighting (5 in the paper).")
    loss_type: Literal["l2", "huber", "smooth_l1"] = Field(
        default="l2",
        description=(
            "The per-element loss between prediction and target, averaged per sample before `loss_weighting`: "
            "`l2` (mean squared error), `huber` (pseudo-Huber) or `smooth_l1`. Every family."
        ),
    )
    huber_schedule: Literal["snr", "exponential", "constant"] = Field(
        default="snr",
        description=(
            "How the threshold c of `huber` / `smooth_l1` follows the noise level: `snr`, `exponential` or "
            "`constant` (`huber_c`). Unused with `loss_type` `l2`."
        ),
    )
    huber_c: float = Field(
        default=0.1,
        gt=0,
        description=(
            "The threshold c of `huber` / `smooth_l1` where the loss turns from squared to linear (the value at "
            "the noisiest step under `huber_schedule` `snr` / `exponential`). Unused with `loss_type` `l2`."
        ),
    )
    masked_loss_probability: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description=(
            "Masked loss: the share of micro-batches of a `mask_type: segmentation` dataset whose loss its masks "
            "weight (one draw per micro-batch, from the seed; 1: every one). A `mask_type: mask` dataset's masks "
            "weight every batch whatever this says, as in SimpleTuner. Unused without `mask_data_dir`."
        ),
    )
    noise_offset: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description=(
            "Offset noise for DDPM families (sd, sdxl): adds `noise_offset` times one normal draw per sample and "
            "channel to the training noise (typical 0.05-0.1; 0: off). Flow-matching families refuse it."
        ),
    )
    noise_offset_probability: float = Field(
        default=0.25,
        ge=0,
        le=1,
        description=(
            "The share of micro-batches that get the `noise_offset` (one draw per micro-batch decides; 1: every "
            "one). Unused while `noise_offset` is 0."
        ),
    )
    mixed_precision: Literal["no", "fp16", "bf16"] = Field(
        default="no",
        description=(
            "Autocast precision for the forward pass. Unset: what `accelerate launch` was asked for, else `no`."
        ),
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass: less memory, ~30% more compute."
    )
    tread_config: Optional[TreadConfig] = Field(
        default=None,
        description=(
            'TREAD token routing (sd3, flux, wan, qwen_image): `{"routes": [{"selection_ratio": 0.5, '
            '"start_layer_idx": 2, "end_layer_idx": -2}]}` lets half of each sample\'s image tokens skip blocks '
            "2 to the one before last while training (less compute and activation memory in those blocks). See the "
            'table below and MODEL_FAMILIES.md, "TREAD token routing".'
        ),
    )
    caption_dropout_probability: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description=(
            "Chance that a training sample's caption is replaced by the empty prompt, so the model also learns "
            "the unconditional prediction classifier-free guidance needs (0.1 is usual; 0: off)."
        ),
    )

    # --- adapter ---
    training_type: Literal["lora", "full"] = Field(
        default="lora",
        description=(
            "`lora`: train an adapter on the denoiser (`lora_type` says which); `full`: train every denoiser weight."
        ),
    )
    lora_type: Literal["standard", "lycoris"] = Field(
        default="standard",
        description=(
            "`standard`: a peft LoRA (optionally DoRA), saved for diffusers' `load_lora_weights`; `lycoris`: a "
            "LyCORIS adapter (`lycoris` table; the `lycoris` extra), saved in LyCORIS' own format."
        ),
    )
    lycoris: LycorisOptions = Field(
        default_factory=LycorisOptions,
        description="LyCORIS options; see the table below. Rank and alpha come from `lora_rank` / `lora_alpha`.",
    )
    lora_rank: int = Field(default=16, ge=1, description="LoRA rank.")
    lora_alpha: Optional[float] = Field(
        default=None, gt=0, description="LoRA alpha; default: equal to `lora_rank` (scale 1)."
    )
    lora_dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the LoRA path.")
    lora_use_dora: bool = Field(
        default=False,
        description=(
            "DoRA: also learn a magnitude per output channel (peft `use_dora`); often closer to a full fine-tune at "
            "the same rank; each step costs more (a weight norm per adapted layer)."
        ),
    )
    lora_target_modules: Optional[list[str]] = Field(
        default=None, description="Module names to adapt; default: the family's attention projections."
    )
    train_text_encoder: bool = Field(
        default=False,
        description=(
            "sd / sdxl with a peft LoRA: also train a LoRA on the CLIP text encoders (sdxl: both) on their attention "
            "projections (`q_proj`, `k_proj`, `v_proj`, `out_proj`; not in the last layer of sdxl's first encoder, "
            "whose output SDXL never reads), with the UNet adapter's `lora_rank`, "
            "`lora_alpha`, `lora_dropout` and DoRA setting, at `text_encoder_lr`. Their embeddings change every "
            "step, so each step encodes its captions (the text cache keeps their token ids only; said at start). "
            "The adapter file holds the encoders' LoRA under `text_encoder.` / `text_encoder_2.`, which the "
            "pipeline's `load_lora_weights` loads with the UNet's."
        ),
    )
    text_encoder_lr: Optional[float] = Field(
        default=None,
        gt=0,
        le=MAX_LEARNING_RATE,
        description=(
            "The learning rate of the text encoders' LoRA (`train_text_encoder`), an optimizer group of its own "
            "under the same schedule; unset: `learning_rate`."
        ),
    )
    output_formats: list[OutputFormat] = Field(
        default=["diffusers"],
        description=(
            "Adapter files the final save writes: `diffusers` (always, `pytorch_lora_weights.safetensors`) and, "
            "beside it, `kohya` (kohya-ss' names: sd-scripts, musubi-tuner) and / or `comfyui` (the names ComfyUI "
            "loads), as `<name>.kohya.safetensors` / `<name>.comfyui.safetensors`; listed in final_weights.json, so "
            "`push_to_hub` uploads them too. The same as `simpletuner export`; which family has which format, and "
            'what each holds: MODEL_FAMILIES.md, "Exporting the adapter". Peft LoRAs only (not LyCORIS or DoRA).'
        ),
    )

    # --- faults ---
    nonfinite_policy: Literal["stop", "skip"] = Field(
        default="stop",
        description=(
            "What happens to a window whose loss or gradient is NaN/inf (it never reaches the optimizer): `stop` "
            "saves the last good state and stops (exit code 3); `skip` drops the window and goes on."
        ),
    )
    max_consecutive_nonfinite: int = Field(
        default=5, ge=1, description="With `nonfinite_policy: skip`, stop after this many non-finite windows in a row."
    )

    # --- checkpoints ---
    checkpointing_steps: Optional[int] = Field(
        default=None, ge=1, description="Save a resumable checkpoint every N optimizer steps."
    )
    checkpoints_total_limit: Optional[int] = Field(
        default=None,
        ge=1,
        description="Keep at most this many checkpoints (oldest removed after a new one is complete).",
    )
    checkpoint_at_end: bool = Field(
        default=True,
        description=(
            "Also save a resumable checkpoint at the run's last step (unless checkpointing_steps already did), so "
            "raising max_train_steps with resume_from_checkpoint 'latest' continues from the end instead of "
            "re-training the tail. false: only the final adapter is written at the end."
        ),
    )
    resume_from_checkpoint: Optional[PathText] = Field(
        default=None,
        description=(
            "`latest`, or a checkpoint folder to resume from. A relative path is taken from the config file's folder "
            "(not the working directory; `--set` values too)."
        ),
    )

    # --- validation ---
    validation_prompt: Optional[str] = Field(
        default=None,
        description="Prompt for validation images; with neither it nor `validation_prompts` there is no validation.",
    )
    validation_prompts: Optional[Union[list[str], str]] = Field(
        default=None,
        description=(
            "Several validation prompts: a list of strings, or the path of a UTF-8 text file with one prompt per "
            "line. With `validation_prompt` as well, both are used, `validation_prompt` first."
        ),
    )
    validation_steps: Optional[int] = Field(
        default=None, ge=1, description="Generate validation images every N optimizer steps (and at the start and end)."
    )
    num_validation_images: int = Field(
        default=1,
        ge=1,
        description=(
            "Images per prompt at each validation (the columns of the grid); every prompt's images start from the "
            "same seed (`seed`)."
        ),
    )
    validation_num_inference_steps: int = Field(default=20, ge=1, description="Sampler steps for validation images.")
    validation_guidance_scale: float = Field(
        default=7.5, ge=0, description="Classifier-free guidance scale for validation images."
    )
    validation_resolution: Optional[Union[int, str]] = Field(
        default=None,
        description=(
            'Size of the validation images: a number (`1024`: square), `"WIDTHxHEIGHT"` (`"832x480"`), or several '
            "of those separated by commas, each rendering every prompt. Unset: `resolution` square."
        ),
    )
    validation_negative_prompt: Optional[str] = Field(
        default=None,
        description=(
            "Negative prompt for validation images, used where classifier-free guidance is on "
            "(`validation_guidance_scale` > 1). Unset: none."
        ),
    )
    validation_image: Optional[Union[list[PathText], PathText]] = Field(
        default=None,
        description=(
            "The image an image-conditioned family renders from (Qwen-Image-Edit: the source to edit; Flux Kontext: "
            "the reference, scaled to each validation size's area; Wan 2.2 I2V "
            "/ TI2V with `ti2v_first_frame`: the first frame): one file for every validation prompt, or a list "
            "with one per prompt."
        ),
    )
    validation_seed: Optional[int] = Field(
        default=None,
        ge=0,
        le=2**32 - 1,
        description=(
            "Seed of every validation prompt's noise (each validation starts every prompt from it, so steps differ "
            "only by the training in between). Unset: `seed`."
        ),
    )
    validation_guidance_rescale: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description=(
            "Guidance rescale (the `guidance_rescale` of diffusers' SD / SDXL pipelines), against over-exposure "
            "with v-prediction and zero-terminal-SNR models; 0 turns it off. Only sd and sdxl have it; another "
            "family refuses a non-zero value."
        ),
    )
    validation_num_video_frames: Optional[int] = Field(
        default=None,
        ge=1,
        description=(
            "Video families (wan): frames per validation video, 4k+1 (1, 5, 9, ..., 81); unset or 1: one frame, "
            "saved as a PNG as for images. Image families refuse a value other than 1."
        ),
    )

    # --- performance ---
    enable_tf32: bool = Field(
        default=True,
        description=(
            "Let fp32 matmuls and convolutions use TF32 tensor cores (Ampere and newer): several times faster, "
            "with 10 mantissa bits instead of 23 inside those products. Off: exact fp32; no effect on CPU."
        ),
    )
    enable_compile: bool = Field(
        default=False,
        description=(
            "`torch.compile` the denoiser: faster steps after a compile of tens of seconds to minutes at start-up "
            "and for each new bucket shape (needs a C compiler). Unset: on when the launch asks for the inductor "
            "dynamo backend."
        ),
    )
    num_cpu_threads: Optional[int] = Field(
        default=None,
        ge=1,
        le=1024,
        description=(
            "Threads torch uses for CPU work (intra-op; inter-op too where torch still allows it). Unset: a CPU "
            "run takes the idle cores it may use; a CUDA run keeps torch's default."
        ),
    )
    dataloader_num_workers: int = Field(
        default=0,
        ge=0,
        le=256,
        description=(
            "Threads that read and decode images ahead of the VAE while the latent cache fills (0: decode in the "
            "training process between VAE batches)."
        ),
    )
    dataloader_persistent_workers: bool = Field(
        default=False,
        description=(
            "Keep the image-decoding threads alive between epochs instead of starting them for each re-encode "
            "(only matters with `augmentations_cache_mode` `refresh_each_epoch` or `disable_cache`)."
        ),
    )
    augmentations: Augmentations = Field(
        default_factory=Augmentations, description="Image augmentations; see the table below."
    )
    augmentations_cache_mode: Literal["disable_cache", "static", "refresh_each_epoch"] = Field(
        default="static",
        description=(
            "How augmented images meet the latent cache: `static` (one augmented version per image, encoded "
            "once), `refresh_each_epoch` (re-encoded with new augmentations each epoch) or `disable_cache` (each "
            "batch encoded as it is trained)."
        ),
    )
    dataloader_pin_memory: bool = Field(
        default=False,
        description="Pin decoded image batches (CUDA only) so their copy to the GPU is faster; costs page-locked RAM.",
    )
    cuda_allocator: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "PyTorch CUDA caching-allocator settings, written to PYTORCH_CUDA_ALLOC_CONF before CUDA starts (keys "
            "given here win over the environment's). Only keys a stock PyTorch accepts, each value as PyTorch "
            "reads it."
        ),
    )

    # --- logging ---
    logging_steps: int = Field(
        default=10,
        ge=1,
        description=(
            "Log loss, lr, samples/s, step time, data-wait share and MFU every N optimizer steps (one host sync per "
            "log)."
        ),
    )
    eval_steps: Optional[int] = Field(
        default=None,
        ge=1,
        description=(
            "Every N optimizer steps, log `eval_loss`: the loss on `eval_iters` fixed micro-batches with fixed "
            "noise and timesteps, without gradients. Comparable across steps, unlike the noisy training loss."
        ),
    )
    eval_iters: int = Field(default=4, ge=1, description="Micro-batches in each `eval_loss` (more: steadier, slower).")
    report_to: Literal["none", "tensorboard", "wandb"] = Field(
        default="none", description="Experiment tracker (through Accelerate)."
    )
    tracker_project_name: FolderName = Field(
        default="simpletuner",
        description="Project name for the tracker; also the name of its log folder under `output_dir/logs`.",
    )

    # --- Hub uploads ---
    push_to_hub: bool = Field(
        default=False,
        description=(
            "When training ends, upload the final weights, a model card and the last validation images to the "
            "Hugging Face Hub repo `hub_model_id`. The upload runs in the background and never fails the run: a "
            "failed one is retried, then reported with the command that uploads it by hand. Needs a write token "
            "(`hf auth login`, or `HF_TOKEN`), checked before training starts."
        ),
    )
    push_checkpoints_to_hub: bool = Field(
        default=False,
        description=(
            "With `push_to_hub`: also upload each checkpoint, to `checkpoint-N/` of the repo and (the adapter and "
            "its card) to the repo's root, so the root always holds the newest weights. A full fine-tune's "
            "checkpoint (resumable state, not a diffusers folder) goes to `checkpoint-N/` only."
        ),
    )
    push_to_hub_background: bool = Field(
        default=True,
        description=(
            "Checkpoint uploads run beside training; false: training waits for each (SimpleTuner's default). "
            "The final upload is always waited for before the command ends."
        ),
    )
    hub_model_id: Optional[str] = Field(
        default=None,
        description=(
            "The repo to upload to: `org/name`, or `name` for the account of the token (a huggingface.co URL is "
            "read as its id). Unset: `tracker_project_name`, as in SimpleTuner."
        ),
    )
    model_card_private: bool = Field(
        default=True, description="Create the repo private (a repo that exists keeps its visibility)."
    )
    model_card_note: Optional[str] = Field(default=None, description="A note shown near the top of the model card.")
    model_card_safe_for_work: bool = Field(
        default=False,
        description="Tag the model card `safe-for-work` instead of `not-for-all-audiences` (as SimpleTuner tags it).",
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

    @field_validator("hub_model_id", mode="before")
    @classmethod
    def _repo_id_read(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        repo_id = normalise_repo_id(value)
        if problem := repo_id_problem(repo_id):
            raise ValueError(problem)
        return repo_id

    @property
    def hub_repo_id(self) -> str:
        """The repo uploads go to: `hub_model_id`, else `tracker_project_name` (SimpleTuner's rule)."""
        return self.hub_model_id or normalise_repo_id(self.tracker_project_name)

    @field_validator("optimizer_config", mode="before")
    @classmethod
    def _optimizer_config_read(cls, value: Any) -> Any:
        return parse_optimizer_config(value)  # SimpleTuner's "key=value,..." string -> a dict

    @model_validator(mode="before")
    @classmethod
    def _optimizer_defaults(cls, data: Any) -> Any:
        return with_optimizer_defaults(data)  # a SimpleTuner-named optimizer's own defaults for what is left out

    @model_validator(mode="before")
    @classmethod
    def _resolution_of_the_datasets(cls, data: Any) -> Any:
        """Unset `resolution` where every dataset sets its own: the largest of theirs (what the run trains at most;
        the estimate, the position check and the default validation size read it), not an unused 512."""
        if not isinstance(data, dict) or "resolution" in data:
            return data
        datasets = data.get("datasets")
        if not isinstance(datasets, list) or not datasets or not all(isinstance(d, dict) for d in datasets):
            return data
        sizes = [d.get("resolution") for d in datasets if d.get("disabled") is not True]
        if sizes and all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in sizes):
            return {**data, "resolution": max(sizes)}
        return data

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
        several = cast(Optional[list[str]], self.validation_prompts)  # a prompt file was read into its prompts
        return merged_prompts(self.validation_prompt, several)
