"""The dataset entries of the configuration: the fields every dataset shares, one config class per
storage backend (``type``), and their discriminated union ``DatasetConfig``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, Optional, Union
from urllib.parse import quote

from pydantic import AfterValidator, Field, field_validator, model_validator

from simpletuner.configuration.rules import DATASET_RULES, Rule, check_rules
from simpletuner.configuration.sections import MAX_RESOLUTION, CacheFolderText, CaptionStrategy, PathText, _Strict


class MetadataFileOptions(_Strict):
    """A table of captions (Parquet, CSV or JSON lines): one row per image, matched by file name."""

    path: PathText = Field(
        ...,
        description=(
            "The metadata file, relative to the folder of the config file that loads it (like "
            "`instance_data_dir`). Under `parquet` the extension picks the reader: `.jsonl`, `.json`, `.csv`, "
            "anything else Parquet (the `parquet` extra)."
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
        default=None,
        min_length=1,
        description="Column whose caption is used where `caption_column` is empty or null.",
    )
    identifier_includes_extension: bool = Field(
        default=False,
        description=(
            "`true`: `filename_column` values carry the file extension (`cat.png`) and must match exactly; "
            "`false`: they do not (`cat`), and an extension written there anyway is dropped before matching."
        ),
    )
    conditioning_column: Optional[str] = Field(
        default=None,
        min_length=1,
        description=(
            "Edit models (Qwen-Image-Edit, Flux Kontext): column naming each row's source image, a path with its "
            "extension "
            "relative to the dataset's `conditioning_data_dir` (its `instance_data_dir` when that is unset), or "
            "absolute."
        ),
    )
    width_column: Optional[str] = Field(
        default=None,
        min_length=1,
        description=(
            "Column of each image's width in pixels, read together with `height_column`. Sizes still come from "
            "the image headers (a fast read); rows whose size differs are counted in one warning."
        ),
    )
    height_column: Optional[str] = Field(
        default=None, min_length=1, description="Column of each image's height in pixels (see `width_column`)."
    )


class CaptionShuffle(_Strict):
    """SimpleTuner's `caption_shuffle` of a dataset: shuffled copies of tag captions, each encoded once."""

    enable: bool = Field(
        default=False,
        description=(
            "Turn shuffling on: each caption (each line of a caption file) gives itself and `count` shuffled copies, "
            "each encoded once at the start; every draw of the image trains on one of them, chosen from the seed."
        ),
    )
    count: int = Field(default=1, ge=1, le=100, description="Shuffled copies made of each caption.")
    seed: Optional[int] = Field(
        default=None,
        description=(
            "Seed of the shuffles (each copy `i` of a caption shuffles with `seed` + a hash of the caption + `i`, as "
            "SimpleTuner does). Unset: the run's `seed`."
        ),
    )
    split_on: Literal["comma", "space", "period"] = Field(
        default="comma",
        description=(
            "What separates the tags: `comma` (joined again with `, `), `space` (` `) or `period` (`. `); empty "
            "tags are dropped and each tag is stripped."
        ),
    )
    position_start: int = Field(
        default=0,
        ge=0,
        description=(
            "Tags kept in place at the front (kohya's `keep_tokens`): only the tags after them are shuffled. A "
            "caption with fewer than `position_start` + 2 tags is not shuffled."
        ),
    )
    include_original: bool = Field(
        default=True,
        description="Keep the caption as written among the captions drawn (false: only the shuffled copies).",
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


class ConditioningGenerator(_Strict):
    """Conditioning images made from each training image at start (SimpleTuner's dataset `conditioning` block): the
    ControlNet control images or the edit models' sources, paired with their images as `conditioning_data_dir`'s."""

    type: Literal["canny"] = Field(
        description=(
            "`canny`: the image's Canny edge map, as SimpleTuner's generator computes it (grey, Gaussian blur 1.4, "
            "Sobel, thin, hysteresis between the two thresholds; white edges on black)."
        )
    )
    low_threshold: float = Field(
        default=50.0, gt=0, description="Edge strength that continues an edge found above `high_threshold`."
    )
    high_threshold: float = Field(
        default=100.0, gt=0, description="Edge strength that starts an edge (at least `low_threshold`)."
    )
    instance_data_dir: Optional[PathText] = Field(
        default=None,
        description=(
            "Where the generated images are written (the same relative paths and names as the images; a folder this "
            "run owns: files without an image are removed); unset: `<cache_dir>/conditioning_data/<id>_conditioning_"
            "<type>`, as SimpleTuner. Regenerated when an image or the settings change."
        ),
    )

    @model_validator(mode="after")
    def _thresholds_in_order(self):
        if self.low_threshold > self.high_threshold:
            raise ValueError(
                f"low_threshold {self.low_threshold:g} is above high_threshold {self.high_threshold:g}: swap them"
            )
        return self


class FolderDatasetConfig(_Strict):
    """Fields every folder-of-images dataset shares, whatever its storage backend."""

    cross_field_rules: ClassVar[tuple[Rule, ...]] = DATASET_RULES

    id: str = Field(..., min_length=1, description="Unique name of this dataset; used in cache paths and logs.")
    instance_data_dir: PathText = Field(
        ...,
        description=(
            "Folder searched recursively for .jpg/.jpeg/.png/.webp images; for `dataset_type: video`, for clips "
            "(.mp4/.webm/.mov/.mkv/.gif/.webp) and frame folders (one sub-folder of numbered frames per clip)."
        ),
    )
    dataset_type: Literal["image", "video"] = Field(
        default="image",
        description=(
            "`image`: still images. `video`: short clips or folders of numbered frames (one sub-folder per clip), "
            "each training as `num_frames` frames taken every `frame_stride` frames from the start; it needs a "
            "video family (wan)."
        ),
    )
    num_frames: Optional[int] = Field(
        default=None,
        ge=1,
        le=1025,
        description=(
            "Video datasets: frames per training clip, of the form 4k+1 (1, 5, 9, ..., 81). Required for `video`."
        ),
    )
    frame_stride: int = Field(
        default=1,
        ge=1,
        le=100,
        description="Video datasets: take every N-th frame of the source clip (1: consecutive frames; at most 100).",
    )
    caption_strategy: CaptionStrategy = Field(
        default="textfile",
        description=(
            "Where each caption comes from: `textfile`, `filename`, `filename_cleaned`, `instance_prompt`, or a "
            "row of a metadata file (`parquet` / `csv` / `jsonl`)."
        ),
    )
    disable_multiline_split: bool = Field(
        default=False,
        description=(
            "`caption_strategy: textfile`: false (SimpleTuner's default), each line of a caption file is a "
            "caption of its own; true: the whole file is one caption, line breaks kept."
        ),
    )
    instance_prompt: Optional[str] = Field(
        default=None, description="Caption used by the `instance_prompt` strategy and as the textfile fallback."
    )
    prepend_instance_prompt: bool = Field(
        default=False,
        description=(
            "Put `instance_prompt` and a space before every caption read from elsewhere (a .txt file, the file "
            "name, a metadata file): `sks dog` + `on a sofa` -> `sks dog on a sofa`. Needs `instance_prompt`."
        ),
    )
    caption_shuffle: Optional[CaptionShuffle] = Field(
        default=None,
        description=(
            "SimpleTuner's tag shuffling (`enable`, `count`, `seed`, `split_on`, `position_start`, "
            "`include_original`; see the table below): shuffled copies of each caption, encoded once, one drawn "
            "per use. `prepend_instance_prompt` goes before the shuffled tags."
        ),
    )
    parquet: Optional[MetadataFileOptions] = Field(
        default=None,
        description=(
            "With `caption_strategy: parquet`: the metadata file (`path`, `filename_column`, `caption_column`, ...; "
            "see the table below)."
        ),
    )
    csv: Optional[MetadataFileOptions] = Field(
        default=None,
        description="With `caption_strategy: csv`: a CSV file with a header row (UTF-8), the same keys as `parquet`.",
    )
    jsonl: Optional[MetadataFileOptions] = Field(
        default=None,
        description=(
            "With `caption_strategy: jsonl`: a JSON-lines file (one object a line), the same keys as `parquet`."
        ),
    )
    resolution: Optional[SizeValue] = Field(
        default=None,
        gt=0,
        le=MAX_RESOLUTION,
        description=(
            "Overrides the top-level `resolution` for this dataset; like it, a multiple of `aspect_bucket_alignment`. "
            "With `resolution_type: area` it is megapixels instead (a fraction such as 1.0 or 0.25, at most 64), "
            "and the dataset must give it."
        ),
    )
    crop_style: Literal["center", "random", "corner"] = Field(
        default="center",
        description=(
            "Where the crop window sits in the resized image: `center`; `random`, a fixed offset per image from "
            "the seed, so caches stay valid; `corner`, the top-left corner."
        ),
    )
    crop: Optional[bool] = Field(
        default=None,
        description=(
            "SimpleTuner's crop switch: set (as `resolution_type`), this dataset uses SimpleTuner's bucket sizes. "
            "`true`: the bucket comes from `crop_aspect`; `false`: every image keeps its aspect."
        ),
    )
    crop_aspect: Optional[CropAspect] = Field(
        default=None,
        description=(
            "With `crop: true`, the bucket's aspect: `square` (the default), `preserve` (the image's own), "
            "`closest` or `random` (from `crop_aspect_buckets`)."
        ),
    )
    crop_aspect_buckets: Optional[list[Union[float, AspectBucket]]] = Field(
        default=None,
        min_length=1,
        description=(
            "For `crop_aspect` `closest` / `random`: aspect ratios (width / height) to choose from, all numbers "
            '(`[0.75, 1.0, 1.5]`) or all objects `{"aspect": 1.5, "weight": 0.25}` whose weights add up to 1.'
        ),
    )
    resolution_type: Optional[ResolutionType] = Field(
        default=None,
        description=(
            "SimpleTuner's unit of `resolution` and the size keys: `pixel` (the shorter side), `area` "
            "(megapixels) or `pixel_area` (a side whose square is the area). Set (as `crop`), this dataset uses "
            "SimpleTuner's bucket sizes."
        ),
    )
    maximum_image_size: Optional[SizeValue] = Field(
        default=None,
        gt=0,
        description=(
            "With `crop: true` and `target_downsample_size`: an image larger than this is first resized, aspect "
            "kept, to `target_downsample_size`, and its bucket cropped from that. Units follow `resolution_type`."
        ),
    )
    target_downsample_size: Optional[SizeValue] = Field(
        default=None,
        gt=0,
        description=(
            "The size images above `maximum_image_size` are resized to before the crop (`pixel`: their shorter side; "
            "`area`: megapixels; `pixel_area`: a side whose square is their area); never smaller than needed to cover "
            "the bucket. At most `maximum_image_size`."
        ),
    )
    minimum_aspect_ratio: Optional[float] = Field(
        default=None,
        gt=0,
        description=(
            "Skip images whose aspect ratio (width / height) is below this, e.g. 0.5 drops images taller than 1:2; "
            "the scan reports how many. Unset: none skipped for aspect."
        ),
    )
    maximum_aspect_ratio: Optional[float] = Field(
        default=None,
        gt=0,
        description=(
            "Skip images whose aspect ratio (width / height) is above this, e.g. 3.0 drops panoramas wider than 3:1; "
            "the scan reports how many. Unset: none skipped for aspect."
        ),
    )
    repeats: int = Field(default=0, ge=0, description="Extra passes over this dataset per epoch (0 = each image once).")
    is_regularisation_data: bool = Field(
        default=False,
        description=(
            "Regularisation (prior-preservation) images: in an adapter run their target is the frozen base "
            "model's own prediction, so the adapter learns to leave such images as the base model draws them."
        ),
    )
    probability: float = Field(
        default=1.0,
        ge=0,
        description=(
            "Sampling weight of this dataset against the others: each step's batch comes from one dataset, drawn "
            "with chance proportional to `probability` x its batches per epoch. 0 leaves the dataset out."
        ),
    )
    disabled: bool = Field(
        default=False,
        description=(
            "`true`: leave this dataset out of the run (not scanned, not cached, said once in the log); the entry "
            "is still checked, so a typo in it is still refused."
        ),
    )
    conditioning_data_dir: Optional[PathText] = Field(
        default=None,
        description=(
            "Edit models (Qwen-Image-Edit, Flux Kontext): folder of source (conditioning, reference) images, one per "
            "image of "
            "`instance_data_dir` at the same relative path and file name (the extension may differ); the caption "
            "is the edit instruction."
        ),
    )
    conditioning: Optional[ConditioningGenerator] = Field(
        default=None,
        description=(
            "ControlNet and edit models: generate each image's conditioning (source) image at start instead of "
            'reading a `conditioning_data_dir`, e.g. `{"type": "canny"}` (SimpleTuner\'s `conditioning` block). Works '
            "with every dataset type, Hub datasets included; generated once, kept on disk."
        ),
    )
    mask_data_dir: Optional[PathText] = Field(
        default=None,
        description=(
            "Masked loss: folder of mask images, one per image of `instance_data_dir` at the same relative path and "
            "file name (the extension may differ); an image without one stops the run, naming it. Each mask gets "
            "its image's resize, crop and flip, is averaged over each latent pixel and weights that pixel's loss "
            "(white 1, black 0; the loss is still divided by every pixel). SimpleTuner's `conditioning_type: mask` "
            "dataset. Still images only."
        ),
    )
    mask_type: Optional[Literal["mask", "segmentation"]] = Field(
        default=None,
        description=(
            "How a mask of `mask_data_dir` weights the loss: `mask` (unset: this), by its red channel's grey, in "
            "every batch; `segmentation`, 1 where any pixel of a latent pixel is not black, else 0, in a share "
            "`masked_loss_probability` of batches. SimpleTuner's `conditioning_type` of the mask dataset."
        ),
    )
    cache_dir_vae: Optional[CacheFolderText] = Field(
        default=None,
        description=(
            "Folder of this dataset's VAE latents instead of `<cache_dir>/<model_family>/vae`; `{model_family}`, "
            "`{id}` (this dataset's id) and `{output_dir}` are replaced by their values."
        ),
    )
    minimum_image_size: Optional[SizeValue] = Field(
        default=None,
        gt=0,
        description=(
            "Skip images (clips: their first frame) smaller than this, whatever `resolution` is; the unit follows "
            "`resolution_type`. Unset: none skipped for size."
        ),
    )
    allow_upscale: Optional[bool] = Field(
        default=None,
        description=(
            "Images smaller than their bucket. Unset: scaled up to cover it, unless too many need more than 2x; "
            "`false`: skipped; `true`: upscaled, any factor."
        ),
    )

    @model_validator(mode="after")
    def _prompt_needed(self):
        return check_rules(self)


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
#: fsspec protocols that name the local disk: such a dataset is `type: local`.
LOCAL_PROTOCOLS = frozenset({"file", "local"})


def url_protocol(value: str) -> Optional[str]:
    """``"s3"`` for ``"s3://bucket/prefix"``; None for a path without ``<protocol>://``."""
    match = _URL.match(value)
    return match.group(1).lower() if match else None


def object_store_url_problem(value: str) -> Optional[str]:
    """Why ``value`` is not an object store URL fsspec can open, or None."""
    protocol = url_protocol(value)
    if protocol is None or protocol in LOCAL_PROTOCOLS:
        return (
            f"{value!r} is a local path: `type: object_store` reads an object store URL such as s3://bucket/prefix; "
            "for a folder on this machine use `type: local` (or `type: in_memory`)"
        )
    from fsspec.registry import known_implementations, registry  # fsspec comes with huggingface_hub

    if protocol not in known_implementations and protocol not in registry:
        return (
            f"{value!r}: fsspec knows no protocol {protocol!r}; use s3://, gs://, az://, http(s)://, ... "
            "(`type: local` for a folder on this machine)"
        )
    if protocol in ("s3", "s3a", "gs", "gcs") and not value.split("://", 1)[1].split("/", 1)[0]:
        return f"{value!r} names no bucket: give {protocol}://<bucket>/<prefix>"
    return None


class LocalDatasetConfig(FolderDatasetConfig):
    """A folder of images on local disk (searched recursively), read when needed."""

    type: Literal["local"] = Field(..., description="Storage backend: `local` reads files from disk. Required.")

    @field_validator("instance_data_dir")
    @classmethod
    def _a_folder_not_a_url(cls, value: str) -> str:
        if url_protocol(value) is not None:
            raise ValueError(
                f"{value!r} is a URL: `type: local` reads a folder on this machine; for an object store use "
                "`type: object_store` (or `type: in_memory` to stage it in RAM)"
            )
        return value


class InMemoryOptions(_Strict):
    """How an `in_memory` dataset is staged in CPU RAM."""

    compression: Literal["lz4", "zlib", "snappy", "none"] = Field(
        default="none",
        description=(
            "Codec for staged bytes. Applied to files that compress (captions, raw formats); already-compressed "
            "images (JPEG/PNG/WebP) are kept as they are unless `compress_encoded_images` is true."
        ),
    )
    compress_encoded_images: bool = Field(
        default=False, description="Also compress JPEG/PNG/WebP bytes (usually gains ~0% and costs CPU)."
    )
    num_workers: Optional[int] = Field(
        default=None, ge=1, description="Parallel loader threads; default min(72, CPU count)."
    )
    memory_limit_gb: Optional[float] = Field(
        default=None,
        gt=0,
        description="Refuse to stage (before reading anything) when the estimated bytes exceed this many GB.",
    )


class InMemoryDatasetConfig(FolderDatasetConfig):
    """A folder of images staged whole in CPU RAM at start-up (GH200 / GB10: no disk I/O while training)."""

    type: Literal["in_memory"] = Field(
        ..., description="Storage backend: `in_memory` stages every file in RAM at start-up."
    )
    in_memory: InMemoryOptions = Field(
        default_factory=InMemoryOptions, description="Staging options; see the table below."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "With an object store URL as `instance_data_dir` (`s3://bucket/prefix`): options of its fsspec "
            "filesystem, as for `type: object_store`; staging reads every object through it. Refused for a local "
            "folder."
        ),
    )
    max_retries: int = Field(
        default=5,
        ge=0,
        le=100,
        description="With a URL: further attempts after a transient failure, as for `object_store`.",
    )
    retry_backoff_seconds: float = Field(
        default=0.5,
        ge=0,
        le=60,
        description="With a URL: wait before the first retry (doubled each time), as for `object_store`.",
    )

    @field_validator("instance_data_dir")
    @classmethod
    def _a_folder_or_a_store(cls, value: str) -> str:
        if url_protocol(value) is not None:
            problem = object_store_url_problem(value)
            if problem:
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _options_need_a_url(self):
        if url_protocol(self.instance_data_dir) is None and self.storage_options:
            raise ValueError(
                "`storage_options` applies to an object store URL (`s3://bucket/prefix`), and `instance_data_dir` "
                "is a local folder: remove `storage_options`"
            )
        return self


class ObjectStoreDatasetConfig(FolderDatasetConfig):
    """Images in an object store (``s3://``, ``gs://``, ``http(s)://``, ... through fsspec), read when needed."""

    type: Literal["object_store"] = Field(
        ..., description="Storage backend: `object_store` reads files from an fsspec URL (`s3://bucket/prefix`)."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Keyword arguments of the fsspec filesystem of `instance_data_dir`'s protocol; unset: credentials "
            "come from where botocore looks. Prefer the environment for secrets: this file may be copied into the "
            "output folder."
        ),
    )
    max_retries: int = Field(
        default=5,
        ge=0,
        le=100,
        description=(
            "Further attempts of a listing or read after a transient failure (connection dropped, refused or "
            "timed out, HTTP 5xx, throttling); 0: one attempt."
        ),
    )
    retry_backoff_seconds: float = Field(
        default=0.5,
        ge=0,
        le=60,
        description="Wait before the first retry; doubled for each further one (with jitter, at most 30 s).",
    )

    @field_validator("instance_data_dir")
    @classmethod
    def _a_store_url(cls, value: str) -> str:
        problem = object_store_url_problem(value)
        if problem:
            raise ValueError(problem)
        return value


def _shard_dataset_fields(ds):
    """What a dataset kept in shard files (``webdataset``, ``parquet``) cannot do: its files exist only
    inside the shards, so clips (read by path) and edit pairs (paired with files on disk) are refused."""
    if ds.dataset_type == "video":
        yield (
            f"dataset_type 'video' cannot read clips from `type: {ds.type}` shards: keep clips in a `local` dataset, "
            "or set `dataset_type: image`"
        )
    if ds.conditioning_data_dir is not None:
        yield (
            f"`conditioning_data_dir` (edit pairs) pairs source images with files on disk by path; a `type: {ds.type}` "
            "dataset has none: use a `local` dataset for edit pairs, or remove the key"
        )
    if ds.mask_data_dir is not None:
        yield (
            f"`mask_data_dir` (masked loss) pairs masks with files on disk by path; a `type: {ds.type}` dataset has "
            "none: use a `local` dataset for masked loss, or remove the key"
        )
    for name in ("parquet", "csv", "jsonl"):
        table = getattr(ds, name)
        if table is not None and table.conditioning_column is not None:
            yield (
                f"`{name}.conditioning_column` (edit pairs) is not supported by a `type: {ds.type}` dataset: use a "
                "`local` dataset for edit pairs, or remove the key"
            )


class WebDatasetConfig(FolderDatasetConfig):
    """webdataset-style tar shards (``<key>.jpg`` + ``<key>.txt`` members), streamed: nothing is extracted."""

    cross_field_rules: ClassVar[tuple[Rule, ...]] = DATASET_RULES + (_shard_dataset_fields,)

    type: Literal["webdataset"] = Field(
        ..., description="Storage backend: `webdataset` reads images and captions from the `.tar` shards."
    )
    instance_data_dir: PathText = Field(
        ...,
        description=(
            "Folder searched recursively for `.tar` shards (hidden ones skipped), read in sorted order and in "
            "place: nothing is extracted. Shards must be plain tar (decompress .tar.gz)."
        ),
    )


class _ParquetRows(FolderDatasetConfig):
    """What the Parquet types share (``parquet``, ``huggingface``): one row per image, its encoded bytes in
    ``image_column`` and its caption in ``caption_column``, read in place from the files."""

    cross_field_rules: ClassVar[tuple[Rule, ...]] = DATASET_RULES + (_shard_dataset_fields,)

    image_column: str = Field(
        default="image",
        min_length=1,
        description=(
            "Column of encoded image bytes (JPEG/PNG/WebP): binary, or the Hugging Face Image struct "
            "`{bytes, path}`. A row whose bytes are null counts as an unreadable image (`max_bad_image_fraction`)."
        ),
    )
    caption_column: Optional[str] = Field(
        default="text",
        min_length=1,
        description=(
            "Column of captions (text, or a list of texts: the first non-empty one), each row's caption file for "
            "`caption_strategy: textfile`; null: no caption column."
        ),
    )
    filename_column: Optional[str] = Field(
        default=None,
        min_length=1,
        description=(
            "Column naming each row's image (its last path component is used). Unset: the Image struct's `path`, "
            "else the row number (`000123.png`, the extension from the bytes)."
        ),
    )


class ParquetDatasetConfig(_ParquetRows):
    """Parquet files holding image bytes and captions (as Hugging Face `datasets` stores them), streamed."""

    type: Literal["parquet"] = Field(
        ..., description="Storage backend: `parquet` reads image bytes and captions from the `.parquet` files."
    )
    instance_data_dir: PathText = Field(
        ...,
        description=(
            "Folder searched recursively for `.parquet` files (hidden ones skipped), read in sorted order and in "
            "place, one row per image (a Hugging Face dataset's `data/` folder works as it is)."
        ),
    )


#: A repo id as the Hub takes one (huggingface_hub's validate_repo_id): ``name`` or ``org/name``, ASCII letters,
#: digits, ``-``, ``_`` and ``.``, each part at most 96 characters, not starting or ending with ``-`` or ``.``.
_REPO_ID = re.compile(r"(?:\b[\w\-.]{1,96}\b/)?\b[\w\-.]{1,96}\b", re.ASCII)
#: A split name as the ``datasets`` library takes one (``train``, ``validation``, ``test``, ``train.clean``).
_SPLIT = re.compile(r"\w+(?:\.\w+)*", re.ASCII)
#: The URL scheme of a Hub repo (huggingface_hub's HfFileSystem): a ``huggingface`` dataset's location.
HUB_DATASET_URL = "hf://datasets/"


def hub_repo_id_problem(value: str) -> Optional[str]:
    """Why ``value`` is not a Hub repo id (``org/name``), naming the fix; None when it is one."""
    text = value.strip()
    for prefix in ("https://huggingface.co/datasets/", "http://huggingface.co/datasets/", HUB_DATASET_URL):
        if text.startswith(prefix):
            repo = "/".join(text[len(prefix) :].split("/")[:2])
            return f"{value!r} is a URL: give the repo id alone, `{repo}`"
    if url_protocol(text) is not None or text.startswith((".", "/", "~")) or text.count("/") > 1:
        return (
            f"{value!r} is not a Hub repo id: `dataset_name` is `org/name` as on the dataset's page; for Parquet "
            "files in a folder on this machine use `type: parquet` with `instance_data_dir`"
        )
    if not _REPO_ID.fullmatch(text) or "--" in text or ".." in text or text.endswith(".git"):
        return (
            f"{value!r} is not a Hub repo id: `org/name`, each part letters, digits, `-`, `_` or `.` (at most 96, "
            "not starting or ending with `-` or `.`), as on the dataset's page"
        )
    return None


def hub_dataset_url(repo_id: str, revision: str) -> str:
    """``hf://datasets/org/name@main``: where a ``huggingface`` dataset's files come from (a revision with ``/``,
    such as ``refs/convert/parquet``, URL-quoted as huggingface_hub's HfFileSystem writes it)."""
    return f"{HUB_DATASET_URL}{repo_id}@{quote(revision, safe='')}"


class HuggingFaceDatasetConfig(_ParquetRows):
    """A dataset repo on the Hugging Face Hub: the Parquet files of its split, fetched into the Hub cache through
    huggingface_hub, then read in place as a ``parquet`` dataset (documentation/DATA_SOURCES.md, "Hub datasets")."""

    type: Literal["huggingface"] = Field(
        ...,
        description=(
            "Storage backend: `huggingface` fetches the Parquet files of a Hub dataset's split into the Hub cache "
            "(offline: finds them there) and reads them as `type: parquet` does."
        ),
    )
    instance_data_dir: PathText = Field(
        default=HUB_DATASET_URL,
        description=(
            "Not set for this type: it is `hf://datasets/<dataset_name>@<revision>`, the repo the files come "
            "from. For Parquet files already in a folder use `type: parquet`."
        ),
    )
    dataset_name: str = Field(
        ...,
        description=(
            "The dataset's repo id on the Hub, `org/name` as on its page (https://huggingface.co/datasets/org/name)."
        ),
    )
    split: str = Field(
        default="train",
        description=(
            "The split whose files are read, found by their names as the `datasets` library finds them "
            "(`data/<split>-00000-of-00001.parquet`, a `<split>/` folder, `<split>` in the file name; a repo "
            "without split names is all `train`). A name, not a slice (`train[:10%]`)."
        ),
    )
    revision: str = Field(
        default="main",
        min_length=1,
        description=(
            "Branch, tag or commit of the repo; the commit it resolves to is logged. `refs/convert/parquet` reads "
            "the Hub's own Parquet conversion of a repo that holds image files or another format."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _location_from_the_repo(cls, data: Any) -> Any:
        if isinstance(data, dict) and "instance_data_dir" not in data and isinstance(data.get("dataset_name"), str):
            revision = data.get("revision", "main")
            data = {**data, "instance_data_dir": hub_dataset_url(data["dataset_name"], str(revision))}
        return data

    @field_validator("dataset_name")
    @classmethod
    def _a_repo_id(cls, value: str) -> str:
        problem = hub_repo_id_problem(value)
        if problem:
            raise ValueError(problem)
        return value.strip()

    @field_validator("split")
    @classmethod
    def _a_split_name(cls, value: str) -> str:
        if not _SPLIT.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a split name: give one such as `train`, `validation` or `test` (letters, digits, "
                "`_`; slices such as `train[:10%]` are not supported: the whole split is read)"
            )
        return value

    @model_validator(mode="after")
    def _no_folder(self):
        if self.instance_data_dir != hub_dataset_url(self.dataset_name, self.revision):
            raise ValueError(
                "`instance_data_dir` is not set for `type: huggingface`: the files come from the repo "
                "`dataset_name` (for Parquet files in a folder on this machine use `type: parquet`); remove it"
            )
        return self


#: Every storage backend's config class, one per ``type`` (the members of :data:`DatasetConfig`).
DATASET_CONFIGS: tuple[type[FolderDatasetConfig], ...] = (
    LocalDatasetConfig,
    InMemoryDatasetConfig,
    ObjectStoreDatasetConfig,
    WebDatasetConfig,
    ParquetDatasetConfig,
    HuggingFaceDatasetConfig,
)


def dataset_keys() -> frozenset[str]:
    """Every key a dataset entry of some ``type`` takes."""
    return frozenset(name for model in DATASET_CONFIGS for name in model.model_fields)


# Discriminated on ``type``. A new storage backend adds its config class here, to DATASET_CONFIGS and one line to
# ``simpletuner.data_backend.factory.BUILDERS``.
DatasetConfig = Annotated[
    Union[
        LocalDatasetConfig,
        InMemoryDatasetConfig,
        ObjectStoreDatasetConfig,
        WebDatasetConfig,
        ParquetDatasetConfig,
        HuggingFaceDatasetConfig,
    ],
    Field(discriminator="type"),
]
