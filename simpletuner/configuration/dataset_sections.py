"""The dataset entries of the configuration: the fields every dataset shares, one config class per
storage backend (``type``), and their discriminated union ``DatasetConfig``.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Optional, Union

from pydantic import AfterValidator, Field, model_validator

from simpletuner.configuration.rules import DATASET_RULES, Rule, check_rules
from simpletuner.configuration.sections import MAX_RESOLUTION, CacheFolderText, CaptionStrategy, PathText, _Strict


class MetadataFileOptions(_Strict):
    """A table of captions (Parquet, CSV or JSON lines): one row per image, matched by file name."""

    path: PathText = Field(
        ...,
        description=(
            "The metadata file. A relative path is taken from the folder of the config file that loads it (like "
            "`instance_data_dir`). Under `parquet` the extension picks the reader: `.jsonl` (JSON lines), `.json` "
            "(a JSON array of objects), `.csv`, anything else Parquet (the `parquet` extra: pyarrow)."
        ),
    )
    filename_column: str = Field(
        ...,
        min_length=1,
        description=(
            "Column naming each row's image: its path relative to `instance_data_dir` (`cat.png`, or "
            "`sub/cat.png` for an image in a sub-folder), without the extension unless "
            "`identifier_includes_extension`. Numbers are read as their text (`42` matches `42.png`)."
        ),
    )
    caption_column: str = Field(..., min_length=1, description="Column holding each image's caption.")
    fallback_caption_column: Optional[str] = Field(
        None,
        min_length=1,
        description="Column whose caption is used where `caption_column` is empty or null.",
    )
    identifier_includes_extension: bool = Field(
        False,
        description=(
            "`true`: `filename_column` values carry the file extension (`cat.png`) and must match exactly; "
            "`false`: they do not (`cat`), and an extension written there anyway is dropped before matching."
        ),
    )
    conditioning_column: Optional[str] = Field(
        None,
        min_length=1,
        description=(
            "Edit models (Qwen-Image-Edit): column naming each row's source (conditioning) image, the picture the "
            "instruction in `caption_column` edits into the row's image: a path relative to the dataset's "
            "`conditioning_data_dir` (its `instance_data_dir` when that is unset) or an absolute path, with its "
            "extension. An image of the dataset whose row names no source, or a source that is not a file, stops "
            "the run before caching, naming them."
        ),
    )
    width_column: Optional[str] = Field(
        None,
        min_length=1,
        description=(
            "Column of each image's width in pixels, read together with `height_column`. Sizes still come from "
            "the image headers (a fast read); rows whose size differs are counted in one warning."
        ),
    )
    height_column: Optional[str] = Field(
        None, min_length=1, description="Column of each image's height in pixels (see `width_column`)."
    )


def _whole_to_int(value: float) -> Union[int, float]:
    """``512.0`` -> ``512``: a whole number is an int (so keys and messages read as before); ``1.05`` stays."""
    return int(value) if value.is_integer() else value


#: A size that is pixels (a whole number) or, with `resolution_type: area`, megapixels (a fraction allowed).
SizeValue = Annotated[float, AfterValidator(_whole_to_int)]

ResolutionType = Literal["pixel", "area", "pixel_area"]
CropAspect = Literal["square", "preserve", "closest", "random"]


class AspectBucket(_Strict):
    """One weighted entry of `crop_aspect_buckets`."""

    aspect: float = Field(..., gt=0, description="Aspect ratio, width / height (1.0 square, 1.5 landscape 3:2).")
    weight: float = Field(..., ge=0, description="Chance of this aspect with `crop_aspect: random`; all add up to 1.")


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
            "`instance_prompt`: every image gets `instance_prompt`; "
            "`parquet` / `csv` / `jsonl`: caption from a row of the metadata file of the sub-table of the same name "
            "(images with no row, or an empty caption, are skipped and counted in a warning)."
        ),
    )
    instance_prompt: Optional[str] = Field(
        None, description="Caption used by the `instance_prompt` strategy and as the textfile fallback."
    )
    prepend_instance_prompt: bool = Field(
        False,
        description=(
            "Put `instance_prompt` and a space before every caption read from elsewhere (a .txt file, the file "
            "name, a metadata file): `sks dog` + `on a sofa` -> `sks dog on a sofa`. Needs `instance_prompt`. An "
            "image captioned with `instance_prompt` itself (the strategy, or the textfile fallback) keeps it as is."
        ),
    )
    parquet: Optional[MetadataFileOptions] = Field(
        None,
        description=(
            "With `caption_strategy: parquet`: the metadata file (`path`, `filename_column`, `caption_column`, ...; "
            "see the table below)."
        ),
    )
    csv: Optional[MetadataFileOptions] = Field(
        None,
        description="With `caption_strategy: csv`: a CSV file with a header row (UTF-8), the same keys as `parquet`.",
    )
    jsonl: Optional[MetadataFileOptions] = Field(
        None,
        description=(
            "With `caption_strategy: jsonl`: a JSON-lines file (one object a line), the same keys as `parquet`."
        ),
    )
    resolution: Optional[SizeValue] = Field(
        None,
        gt=0,
        le=MAX_RESOLUTION,
        description=(
            "Overrides the top-level `resolution` for this dataset; like it, a multiple of `aspect_bucket_alignment`. "
            "With `resolution_type: area` it is megapixels instead (a fraction such as 1.0 or 0.25, at most 64), "
            "and the dataset must give it."
        ),
    )
    crop_style: Literal["center", "random", "corner"] = Field(
        "center",
        description=(
            "Where the crop window sits in the resized image: `center`; `random`, a fixed offset per image from "
            "the seed, so caches stay valid; `corner`, the top-left corner."
        ),
    )
    crop: Optional[bool] = Field(
        None,
        description=(
            "SimpleTuner's crop switch; setting it (or `resolution_type`) makes this dataset use SimpleTuner's "
            "bucket sizes (see `resolution_type`). `false`: every image keeps its aspect: resized to cover its "
            "bucket and only the overshoot cropped. `true`: the bucket comes from `crop_aspect`, and "
            "`maximum_image_size` / `target_downsample_size` apply. Unset (with `resolution_type` unset): this "
            "trainer's own buckets, area about `resolution`², aspect as close as `aspect_bucket_alignment` allows "
            "(at most 4:1), only the overshoot cropped."
        ),
    )
    crop_aspect: Optional[CropAspect] = Field(
        None,
        description=(
            "With `crop: true` (ignored with `crop: false`, as in SimpleTuner; refused with `crop` unset), the "
            "bucket's aspect: `square` (the default: every image trains as one square of "
            "the dataset's area), `preserve` (the image's own aspect), `closest` (the aspect of "
            "`crop_aspect_buckets` nearest to the image's), `random` (one of `crop_aspect_buckets` drawn per image "
            "from the seed, by weight when weights are given; fixed per image so caches stay valid)."
        ),
    )
    crop_aspect_buckets: Optional[list[Union[float, AspectBucket]]] = Field(
        None,
        min_length=1,
        description=(
            "For `crop_aspect` `closest` / `random`: aspect ratios (width / height) to choose from, either numbers "
            '(`[0.75, 1.0, 1.5]`, drawn uniformly by `random`) or objects `{"aspect": 1.5, "weight": 0.25}` '
            "whose weights add up to 1 (`random` draws by weight; `closest` ignores weights); all numbers or all "
            "objects."
        ),
    )
    resolution_type: Optional[ResolutionType] = Field(
        None,
        description=(
            "SimpleTuner's unit of `resolution`, `minimum_image_size`, `maximum_image_size` and "
            "`target_downsample_size`; setting it (or `crop`) makes this dataset use SimpleTuner's bucket sizes, each "
            "side rounded to the nearest multiple of `aspect_bucket_alignment` and the image's aspect to 2 decimals. "
            "`pixel`: the image's shorter side becomes `resolution` px, the other follows its aspect (sizes: the "
            "shorter side, px). `area`: `resolution` is megapixels (1.0 gives buckets around 1024x1024; sizes in "
            "megapixels). `pixel_area` (the default once `crop` is set): `resolution` is a side in px whose square is "
            "the bucket area (sizes: sides in px whose squares are compared with the image's area). Unset (with "
            "`crop` unset): this trainer's own buckets (see `crop`)."
        ),
    )
    maximum_image_size: Optional[SizeValue] = Field(
        None,
        gt=0,
        description=(
            "With `crop: true` (ignored with `crop: false`, as in SimpleTuner) and `target_downsample_size`: an "
            "image larger than this (`pixel`: either side above "
            "it; `area`: more megapixels; `pixel_area`: an area above its square) is first resized, aspect kept, to "
            "`target_downsample_size`, then its bucket is cropped from that, so a huge photo keeps its scene "
            "instead of becoming a small tile of it. Units follow `resolution_type`."
        ),
    )
    target_downsample_size: Optional[SizeValue] = Field(
        None,
        gt=0,
        description=(
            "The size images above `maximum_image_size` are resized to before the crop (`pixel`: their shorter side; "
            "`area`: megapixels; `pixel_area`: a side whose square is their area); never smaller than needed to cover "
            "the bucket. At most `maximum_image_size`."
        ),
    )
    minimum_aspect_ratio: Optional[float] = Field(
        None,
        gt=0,
        description=(
            "Skip images whose aspect ratio (width / height) is below this, e.g. 0.5 drops images taller than 1:2; "
            "the scan reports how many. Unset: none skipped for aspect."
        ),
    )
    maximum_aspect_ratio: Optional[float] = Field(
        None,
        gt=0,
        description=(
            "Skip images whose aspect ratio (width / height) is above this, e.g. 3.0 drops panoramas wider than 3:1; "
            "the scan reports how many. Unset: none skipped for aspect."
        ),
    )
    repeats: int = Field(0, ge=0, description="Extra passes over this dataset per epoch (0 = each image once).")
    is_regularisation_data: bool = Field(
        False,
        description=(
            "Regularisation (prior-preservation) images. In an adapter run (`training_type` `lora`, standard or "
            "LyCORIS) their target is the frozen base model's own prediction on the same noisy input (the adapter "
            "switched off, no gradients): the adapter learns to leave such images as the base model draws them. "
            "Costs one more forward pass per such batch. A full fine-tune has no frozen copy and trains them on the "
            "usual target."
        ),
    )
    probability: float = Field(
        1.0,
        ge=0,
        description=(
            "Sampling weight of this dataset against the others. Each step's batch comes from one dataset, drawn "
            "with chance proportional to `probability` x the dataset's batches per epoch (its images with "
            "`repeats`, over `train_batch_size` x processes). Every dataset at the same value (default 1.0): each "
            "is drawn in proportion to its size, the order of a run without the key. 0 leaves the dataset out "
            "(not scanned, not cached, said once in the log). An epoch keeps its length (the batches of every "
            "trained dataset); a weighted-up dataset starts a new shuffled pass when it runs out within one."
        ),
    )
    disabled: bool = Field(
        False,
        description=(
            "`true`: leave this dataset out of the run (not scanned, not cached, said once in the log); the entry "
            "is still checked, so a typo in it is still refused."
        ),
    )
    conditioning_data_dir: Optional[PathText] = Field(
        None,
        description=(
            "Edit models (Qwen-Image-Edit): folder of source (conditioning) images, one per image of "
            "`instance_data_dir` at the same relative path and file name (the extension may differ: `cat.png` pairs "
            "with `cat.jpg`); the caption is the edit instruction. Every image needs its source and every source "
            "its image: a missing or extra one stops the run before caching, naming them. The source gets the "
            "image's own crop and resize (resized to the image's size first; an aspect ratio more than 2% off is "
            "refused), its latents are cached with the image's, and its pixels go into the prompt embedding as the "
            "edit pipeline puts them. A relative path is taken from the config file's folder. A model that is not "
            "an edit model refuses the key."
        ),
    )
    cache_dir_vae: Optional[CacheFolderText] = Field(
        None,
        description=(
            "Folder of this dataset's VAE latents instead of `<cache_dir>/<model_family>/vae` (it holds their "
            "shards and its own cache locks directly). `{model_family}`, `{id}` (this dataset's id) and "
            "`{output_dir}` are replaced by their values. A relative path is taken from the config file's folder. "
            "Datasets naming the same folder share it. Not used when latents are re-encoded while training "
            "(`augmentations_cache_mode` `refresh_each_epoch` / `disable_cache`)."
        ),
    )
    minimum_image_size: Optional[SizeValue] = Field(
        None,
        gt=0,
        description=(
            "Skip images (clips: their first frame) smaller than this, whatever `resolution` is; the scan reports "
            "how many were skipped, and stops, naming the largest, when none is left. The unit follows "
            "`resolution_type`: unset or `pixel`, the shorter side in px; `area`, megapixels of area; `pixel_area`, a "
            "side in px whose square is compared with the area. With `crop: true` and `crop_aspect: square`, `area` "
            "and `pixel_area` also skip images whose shorter side is below the square root of that area. Unset: none "
            "skipped for size."
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
