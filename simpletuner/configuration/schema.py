"""The training configuration: pydantic models, frozen, unknown keys rejected.

Every field carries a description; ``documentation/CONFIG.md`` is generated from these
models (``python -m simpletuner.configuration.docs``) and a test keeps the two in step.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from simpletuner.configuration.alloc_conf import allocator_settings_problems
from simpletuner.configuration.prompts import merged_prompts, prompts_from
from simpletuner.configuration.rules import (
    DATASET_RULES,
    RAMP_RULES,
    TRAINING_RULES,
    Rule,
    folder_name_problem,
    path_problem,
)


class _Strict(BaseModel):
    # allow_inf_nan=False: no setting means anything as nan or inf ("1e400" parses as inf).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _checked(problem):
    """An after-validator raising ``problem(value)``'s message, when there is one."""

    def check(value: str) -> str:
        message = problem(value)
        if message:
            raise ValueError(message)
        return value

    return AfterValidator(check)


#: A file or folder path: not empty, no NUL, each name within the filesystem's limit (255 bytes on
#: most), checked at config time instead of an ``OSError: File name too long`` later.
PathText = Annotated[str, _checked(path_problem)]
#: One folder name (it becomes a folder under output_dir): no separators, within 255 bytes.
FolderName = Annotated[str, _checked(folder_name_problem)]

#: Bounds no real run comes near, so a typo (or 1e12) is refused instead of overflowing later.
MAX_RESOLUTION = 16384
MAX_LEARNING_RATE = 1.0


CaptionStrategy = Literal["textfile", "filename", "instance_prompt"]


class _FolderDatasetConfig(_Strict):
    """Fields every folder-of-images dataset shares, whatever its storage backend."""

    id: str = Field(..., min_length=1, description="Unique name of this dataset; used in cache paths and logs.")
    instance_data_dir: PathText = Field(
        ...,
        description=(
            "Folder searched recursively for .jpg/.jpeg/.png/.webp images; for `dataset_type: video`, for clips "
            "(.mp4/.webm/.mov/.mkv/.gif/.webp) and frame folders (one sub-folder of numbered frames per clip)."
            " A relative path is taken from the folder of the config file that loads it (also when the entry "
            "comes from `data_backend_config`)."
        ),
    )
    dataset_type: Literal["image", "video"] = Field(
        "image",
        description=(
            "`image`: still images. `video`: short clips (.mp4/.webm/.mov/.mkv through the `video` extra, animated "
            ".gif/.webp without it) or folders of numbered frames (one sub-folder per clip); each trains as "
            "`num_frames` frames taken every `frame_stride` frames from the start. Video needs a video family (wan)."
        ),
    )
    num_frames: Optional[int] = Field(
        None,
        ge=1,
        le=1025,
        description="Video datasets: frames per training clip, of the form 4k+1 (1, 5, 9, ..., 81). Required for `video`.",
    )
    frame_stride: int = Field(
        1,
        ge=1,
        le=100,
        description="Video datasets: take every N-th frame of the source clip (1: consecutive frames; at most 100).",
    )
    caption_strategy: CaptionStrategy = Field(
        "textfile",
        description=(
            "`textfile`: caption from a same-named .txt file next to the image, clip or frame folder (`walk.txt` "
            "beside the folder `walk/`; falls back to "
            "`instance_prompt`, then to the file name, and reports how many fell back); "
            "`filename`: caption from the file name (underscores and dashes become spaces); "
            "`instance_prompt`: every image gets `instance_prompt`."
        ),
    )
    instance_prompt: Optional[str] = Field(
        None, description="Caption used by the `instance_prompt` strategy and as the textfile fallback."
    )
    resolution: Optional[int] = Field(
        None,
        gt=0,
        le=MAX_RESOLUTION,
        description="Overrides the top-level `resolution` for this dataset; like it, a multiple of `aspect_bucket_alignment`.",
    )
    crop_style: Literal["center", "random"] = Field(
        "center",
        description="Where to crop when the resized image overshoots its bucket. `random` picks a fixed offset per image from the seed, so caches stay valid.",
    )
    repeats: int = Field(0, ge=0, description="Extra passes over this dataset per epoch (0 = each image once).")
    minimum_image_size: Optional[int] = Field(
        None,
        gt=0,
        description=(
            "Skip images (clips: their first frame) whose shorter side is below this many pixels, whatever "
            "`resolution` is; the scan reports how many were skipped. Unset: none skipped for size."
        ),
    )
    allow_upscale: Optional[bool] = Field(
        None,
        description=(
            "Images smaller than their bucket. Unset: scaled up to cover it, but when more than "
            "`max_bad_image_fraction` of the dataset needs more than 2x the run stops before caching, naming how many "
            "and by how much (fewer: a warning). `false`: every image smaller than its bucket is skipped (counted in "
            "a warning), so nothing is upscaled. `true`: train on them upscaled, any factor (a warning names the far "
            "ones)."
        ),
    )

    @model_validator(mode="after")
    def _prompt_needed(self):
        return _check_rules(self)


class LocalDatasetConfig(_FolderDatasetConfig):
    """A folder of images on local disk (searched recursively), read when needed."""

    type: Literal["local"] = Field(..., description="Storage backend: `local` reads files from disk. Required.")


class InMemoryOptions(_Strict):
    """How an `in_memory` dataset is staged in CPU RAM."""

    compression: Literal["lz4", "zlib", "snappy", "none"] = Field(
        "none",
        description=(
            "Codec for staged bytes. Applied to files that compress (captions, raw formats); already-compressed "
            "images (JPEG/PNG/WebP) are kept as they are unless `compress_encoded_images` is true."
        ),
    )
    compress_encoded_images: bool = Field(
        False, description="Also compress JPEG/PNG/WebP bytes (usually gains ~0% and costs CPU)."
    )
    num_workers: Optional[int] = Field(None, ge=1, description="Parallel loader threads; default min(72, CPU count).")
    memory_limit_gb: Optional[float] = Field(
        None,
        gt=0,
        description="Refuse to stage (before reading anything) when the estimated bytes exceed this many GB.",
    )


class InMemoryDatasetConfig(_FolderDatasetConfig):
    """A folder of images staged whole in CPU RAM at start-up (GH200 / GB10: no disk I/O while training)."""

    type: Literal["in_memory"] = Field(
        ..., description="Storage backend: `in_memory` stages every file in RAM at start-up."
    )
    in_memory: InMemoryOptions = Field(
        default_factory=InMemoryOptions, description="Staging options; see the table below."
    )


# Discriminated on ``type``. A new storage backend adds its config class here and one line to
# ``simpletuner.data_backend.factory.BUILDERS``.
DatasetConfig = Annotated[Union[LocalDatasetConfig, InMemoryDatasetConfig], Field(discriminator="type")]


CacheType = Literal["disk", "memory", "unified_memory"]


class CacheConfig(_Strict):
    """Where VAE latents and text embeddings are cached."""

    cache_dir: PathText = Field(
        "cache",
        description="Root folder of the latent and text-embedding caches. A relative path is taken from the config file's folder (not the working directory; `--set` values too).",
    )
    vae_cache_type: CacheType = Field(
        "disk",
        description=(
            "`disk`: read from disk each batch; `memory`: held in CPU RAM; `unified_memory`: held in CUDA managed "
            "memory advised to stay in CPU RAM and prefetched to the GPU before use, each batch stacked in managed "
            "memory too and placed by role (pinned CPU memory where managed memory is unavailable; a CPU `memory` "
            "cache, said at start, when `gh200_optimizations.enable_uvm_hints` or the environment turns hints off)."
        ),
    )
    text_cache_type: CacheType = Field(
        "disk",
        description="As `vae_cache_type`, for text embeddings; `unified_memory` advises them to stay in GPU memory.",
    )
    persistent_cache: bool = Field(
        True,
        description="Also write `memory` / `unified_memory` caches to `cache_dir` and load them from there next run.",
    )
    verify_content: bool = Field(
        False,
        description=(
            "Off (default): a cached latent is reused while its image keeps its path, size and modification "
            "time, so an image edited in place with those kept (some sync tools, `touch -r`) trains on its old "
            "latent. On: at start the source file of every latent the run would reuse is read, hashed "
            "(blake2b-128) and compared with the hash stored when it was encoded; changed ones are re-encoded and "
            "logged by path. Cost: one read of every reused image per start (measured ~0.25 ms per 180 KiB JPEG "
            "from the page cache, 76 ms for 300; from a cold disk, its read speed). Latents cached before hashes "
            "were stored are re-encoded once. `simpletuner cache verify --content` runs the same check without training."
        ),
    )


class GH200Optimizations(_Strict):
    """Unified-memory hints and the gradient-accumulation ramp."""

    enable_uvm_hints: Optional[bool] = Field(
        None,
        description=(
            "Force unified-memory placement hints on or off. Unset: the environment variable "
            "SIMPLETUNER_GH200_UVM_HINTS (1/0; its alias SIMPLETUNER_GH200_ENABLE_UVM_HINTS, the ai-toolkit fork's "
            "name, also works, and both set to different values stop the run), else on when a cache is "
            "`unified_memory`, else off. Off (here or in the environment) returns `unified_memory` caches to "
            "standard CPU-backed `memory` caches, logged once at start."
        ),
    )
    enable_batch_size_rampup: bool = Field(
        False,
        description="Ramp the effective batch from `initial_effective_batch_size` to `target_effective_batch_size`.",
    )
    initial_effective_batch_size: Optional[int] = Field(
        None, ge=1, description="Effective batch (samples per optimizer step, all processes) at the start of the ramp."
    )
    target_effective_batch_size: Optional[int] = Field(
        None, ge=1, description="Effective batch at the end of the ramp; a multiple of train_batch_size x processes."
    )
    batch_rampup_steps: int = Field(
        0, ge=0, description="Micro-batches over which the ramp goes from initial to target (0: target at once)."
    )

    @model_validator(mode="after")
    def _ramp_complete(self) -> "GH200Optimizations":
        return _check_rules(self)


class Augmentations(_Strict):
    """Random changes to training images before they are encoded (all off by default)."""

    flip_probability: float = Field(0.0, ge=0, le=1, description="Chance of a horizontal flip.")
    crop_jitter: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="Move the crop window by up to this fraction of the bucket side (the image is scaled up just enough to allow it).",
    )
    color_jitter: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Change brightness, contrast and saturation each by a random factor in [1 - x, 1 + x].",
    )

    @property
    def is_enabled(self) -> bool:
        return bool(self.flip_probability or self.crop_jitter or self.color_jitter)


class LycorisOptions(_Strict):
    """The LyCORIS adapter (`lora_type: lycoris`, needs the `lycoris` extra): on the layers `lora_target_modules`
    names, rank `lora_rank`, alpha `lora_alpha`, dropout `lora_dropout`; saved in LyCORIS' own key format
    (`lycoris_<layer>.*`, loadable by LyCORIS-aware tools), not diffusers' `load_lora_weights`."""

    algo: Literal["locon", "loha", "lokr"] = Field(
        "lokr",
        description="`locon` (LoRA on linear and conv layers), `loha` (Hadamard product of two low-rank pairs), `lokr` (Kronecker product).",
    )
    factor: int = Field(
        -1,
        description="LoKr: the size of the smaller Kronecker factor of each weight dimension (-1: as square a split as possible).",
    )
    full_matrix: bool = Field(
        False, description="LoKr: train the larger Kronecker factor as a full matrix instead of a low-rank pair."
    )


class TrainingConfig(_Strict):
    """One training run. Load it with ``simpletuner.configuration.load_config``."""

    # --- model ---
    pretrained_model_name_or_path: PathText = Field(
        ..., min_length=1, description="Local diffusers-format folder (or a hub id where the machine has network)."
    )
    model_family: Literal["sd", "sdxl", "sd3", "flux", "wan"] = Field(
        None,
        validate_default=True,
        description="Omit it to take the family from the model folder's `model_index.json` (`_class_name`: `StableDiffusionPipeline` -> `sd`, `StableDiffusionXLPipeline` -> `sdxl`, `StableDiffusion3Pipeline` -> `sd3`, `FluxPipeline` -> `flux`, `WanPipeline` -> `wan`; the start-up log says where it came from); omitted with a hub id (no local folder): `sd`. Set, it must agree with a local folder's pipeline class, or the config is refused before any data is read. Model family: `sd` (Stable Diffusion 1.x/2.x UNet), `sdxl` (Stable Diffusion XL: two CLIP text encoders, pooled embeds, size/crop time ids), `sd3` (Stable Diffusion 3 MMDiT, flow matching: two CLIP encoders and T5 where present), `flux` (Flux.1 transformer, flow matching with guidance embedding and packed latents: CLIP-L pooled + T5), `wan` (Wan 2.1 / 2.2 text-to-video transformer, flow matching, UMT5 text encoder; image datasets train as 1-frame video; a Wan 2.2 folder holds two experts, `transformer` for high noise and `transformer_2` for low noise, split at the pipeline's `boundary_ratio`).",
    )
    prediction_type: Optional[Literal["epsilon", "v_prediction"]] = Field(
        None, description="Training target; default: the `prediction_type` of the model's scheduler config."
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
        description="Folder for checkpoints, logs, validation images and the final weights. A relative path is taken from the config file's folder (not the working directory; `--set` values too).",
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
        description="Training resolution: images are resized so their area is about resolution², then bucketed by aspect. At most 16384.",
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
        0.05, ge=0, le=1, description="Abort when more than this fraction of a dataset's images cannot be read."
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
        "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"
    ] = Field("constant", description="Learning-rate schedule (diffusers' `get_scheduler`).")
    lr_warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warm-up.")
    optimizer: Literal["adamw", "adam", "sgd", "automagic"] = Field(
        "adamw",
        description=(
            "`adamw`, `adam`, `sgd` (torch), or `automagic`: a learning rate per element, starting at "
            "`learning_rate`, raised by `lr_bump` while its update keeps its sign and lowered when it flips, "
            "within [`min_lr`, `max_lr`]; Adafactor-style factored second moments (about 3 bytes of state per "
            "weight instead of AdamW's 8), decoupled weight decay, stochastic rounding into bf16 weights."
        ),
    )
    lr_bump: float = Field(
        1e-6, gt=0, le=MAX_LEARNING_RATE, description="Automagic: how much an element's learning rate moves per step."
    )
    min_lr: float = Field(1e-7, gt=0, le=MAX_LEARNING_RATE, description="Automagic: lowest per-element learning rate.")
    max_lr: float = Field(1e-3, gt=0, le=MAX_LEARNING_RATE, description="Automagic: highest per-element learning rate.")
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
        1.0, gt=0, description="Clip the gradient norm to this; null disables clipping."
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
        description="Mean of the normal behind `logit_normal` sampling (negative: more low-noise steps).",
    )
    logit_std: float = Field(
        1.0, gt=0, le=10, description="Standard deviation of the normal behind `logit_normal` sampling."
    )
    mode_scale: float = Field(
        1.29,
        ge=-1,
        le=1.75,
        description="Shape of `mode` sampling (SD3's default 1.29); outside [-1, 1.75] the sampled noise levels would leave (0, 1).",
    )
    loss_weighting: Literal["none", "min_snr", "sigma_sqrt", "cosmap"] = Field(
        "none",
        description=(
            "Per-sample loss weights: `none`; `min_snr` (Min-SNR-gamma: caps the weight of low-noise timesteps at "
            "`snr_gamma`, for DDPM schedules (sd, sdxl); identity, with one warning, where the scheduler has no "
            "alphas_cumprod); flow-matching weights for flow families (sd3): `sigma_sqrt` (1 / sigma^2, clamped) "
            "or `cosmap` (SD3's cosine-map weighting)."
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
    snr_gamma: float = Field(5.0, gt=0, description="The gamma of `min_snr` weighting (5 in the paper).")
    mixed_precision: Literal["no", "fp16", "bf16"] = Field(
        "no",
        description=(
            "Autocast precision for the forward pass. Unset: what `accelerate launch` was asked for (`--mixed_precision`, "
            "its `--config_file` or default config file, or `ACCELERATE_MIXED_PRECISION`), else `no`. Set here and in "
            "the launch to different values: the run stops before loading anything, naming both. The precision in "
            "force and its source are logged at start."
        ),
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory, ~30% more compute."
    )

    # --- adapter ---
    training_type: Literal["lora", "full"] = Field(
        "lora",
        description="`lora`: train an adapter on the denoiser (`lora_type` says which); `full`: train every denoiser weight.",
    )
    lora_type: Literal["standard", "lycoris"] = Field(
        "standard",
        description="`standard`: a peft LoRA (optionally DoRA), saved for diffusers' `load_lora_weights`; `lycoris`: a LyCORIS adapter (`lycoris` table; the `lycoris` extra), saved in LyCORIS' own format.",
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
        description="DoRA: also learn a magnitude per output channel (peft `use_dora`); often closer to a full fine-tune at the same rank; each step costs more (a weight norm per adapted layer).",
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
        description="Also save a resumable checkpoint at the run's last step (unless checkpointing_steps already did), so raising max_train_steps with resume_from_checkpoint 'latest' continues from the end instead of re-training the tail. false: only the final adapter is written at the end.",
    )
    resume_from_checkpoint: Optional[PathText] = Field(
        None,
        description="`latest`, or a checkpoint folder to resume from. A relative path is taken from the config file's folder (not the working directory; `--set` values too).",
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
        description="Images per prompt at each validation (the columns of the grid); every prompt's images start from the same seed (`seed`).",
    )
    validation_num_inference_steps: int = Field(20, ge=1, description="Sampler steps for validation images.")
    validation_guidance_scale: float = Field(
        7.5, ge=0, description="Classifier-free guidance scale for validation images."
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
            "at start-up and again for each new bucket shape; needs a C compiler on the machine. Unset: on when the launch asks "
            "for the inductor dynamo backend (`--dynamo_backend inductor`); another backend, or a launch that "
            "disagrees with this key, stops the run."
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
            "`garbage_collection_threshold`, `roundup_power2_divisions`, `backend`, ...; each value as PyTorch reads it "
            '(true/false, whole MB, a threshold between 0 and 1, `backend` "native" or "cudaMallocAsync"). Keys of '
            "patched builds (`use_uvm`, `uvm_*`) are refused with what to use instead."
        ),
    )

    # --- logging ---
    logging_steps: int = Field(
        10,
        ge=1,
        description="Log loss, lr, samples/s, step time, data-wait share and MFU every N optimizer steps (one host sync per log).",
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
                "(sd, sdxl, sd3, flux, wan), or load the config with simpletuner.configuration.load_config"
            )
        return value

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
        return _check_rules(self)

    @property
    def effective_lora_alpha(self) -> float:
        return float(self.lora_alpha if self.lora_alpha is not None else self.lora_rank)

    @property
    def validation_prompt_list(self) -> list[str]:
        """Every validation prompt in the order rendered (the grid's rows): `validation_prompt`, then
        `validation_prompts`, each once; empty when the run does no validation."""
        return merged_prompts(self.validation_prompt, self.validation_prompts)


# --- cross-field rules (rules.py) ------------------------------------------------------------

#: The rules of each model (subclasses inherit their base's).
CROSS_FIELD_RULES: dict[type, tuple[Rule, ...]] = {
    _FolderDatasetConfig: DATASET_RULES,
    GH200Optimizations: RAMP_RULES,
    TrainingConfig: TRAINING_RULES,
}


def rules_for(model: type) -> tuple[Rule, ...]:
    """The cross-field rules of ``model`` (found through its base classes)."""
    for cls in model.__mro__:
        if cls in CROSS_FIELD_RULES:
            return CROSS_FIELD_RULES[cls]
    return ()


def _check_rules(obj):
    """Model-validator body: raise one ValueError with a line per problem, or return ``obj``."""
    problems = [message for rule in rules_for(type(obj)) for message in rule(obj)]
    if problems:
        raise ValueError("\n".join(problems))
    return obj
