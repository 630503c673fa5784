"""The nested parts of the training configuration: datasets, caches, GH200 options, augmentations
and LyCORIS options, and what every config model shares (``_Strict``, the checked path types).
``schema.py`` holds the top-level ``TrainingConfig`` built from them.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from simpletuner.configuration.rules import (
    DATASET_RULES,
    RAMP_RULES,
    Rule,
    check_rules,
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

    cross_field_rules: ClassVar[tuple[Rule, ...]] = DATASET_RULES

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
        description=(
            "Video datasets: frames per training clip, of the form 4k+1 (1, 5, 9, ..., 81). Required for `video`."
        ),
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
        description=(
            "Overrides the top-level `resolution` for this dataset; like it, a multiple of `aspect_bucket_alignment`."
        ),
    )
    crop_style: Literal["center", "random"] = Field(
        "center",
        description=(
            "Where to crop when the resized image overshoots its bucket. `random` picks a fixed offset per image from "
            "the seed, so caches stay valid."
        ),
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
        return check_rules(self)


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
        description=(
            "Root folder of the latent and text-embedding caches. A relative path is taken from the config file's "
            "folder (not the working directory; `--set` values too)."
        ),
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
            "were stored are re-encoded once. `simpletuner cache verify --content` runs the same check without "
            "training."
        ),
    )


class GH200Optimizations(_Strict):
    """Unified-memory hints and the gradient-accumulation ramp."""

    cross_field_rules: ClassVar[tuple[Rule, ...]] = RAMP_RULES

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
        return check_rules(self)


class Augmentations(_Strict):
    """Random changes to training images before they are encoded (all off by default)."""

    flip_probability: float = Field(0.0, ge=0, le=1, description="Chance of a horizontal flip.")
    crop_jitter: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description=(
            "Move the crop window by up to this fraction of the bucket side (the image is scaled up just enough to "
            "allow it)."
        ),
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
        description=(
            "`locon` (LoRA on linear and conv layers), `loha` (Hadamard product of two low-rank pairs), `lokr` "
            "(Kronecker product)."
        ),
    )
    factor: int = Field(
        -1,
        description=(
            "LoKr: the size of the smaller Kronecker factor of each weight dimension (-1: as square a split as "
            "possible)."
        ),
    )
    full_matrix: bool = Field(
        False, description="LoKr: train the larger Kronecker factor as a full matrix instead of a low-rank pair."
    )
