"""Edit pairs: each training image with the source (conditioning) image its caption edits.

Sources are named by ``conditioning_data_dir`` (same relative path and name, any extension) or a caption
table's ``conditioning_column``. :func:`find_sources` stops on a missing, extra or ambiguous source before
anything is cached, :func:`aspect_problem` checks each pair's shapes, and :func:`source_pixels` gives the
source the image's own geometry, so both halves show the same region.
See documentation/MODEL_FAMILIES.md, "Qwen-Image-Edit" (edit pairs).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Iterable, Protocol

import torch

from simpletuner.data_backend.base import IMAGE_EXTENSIONS
from simpletuner.data_backend.caption_files import CaptionTable, metadata_options, strip_media_extension
from simpletuner.data_backend.images import load_rgb, prepare_image, read_image_size

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.configuration.dataset_sections import FolderDatasetConfig
    from simpletuner.data_backend.metadata import Sample

#: Pairs (or files) named in an error message.
NUM_SHOWN = 10
#: How far the aspect ratios of an image and its source may differ (relative) before the pair is refused.
MAX_ASPECT_MISMATCH = 0.02


def listed(items: list[str]) -> str:
    shown = ", ".join(items[:NUM_SHOWN])
    return shown + (f", ... ({len(items) - NUM_SHOWN} more)" if len(items) > NUM_SHOWN else "")


def has_sources(dataset_cfg: FolderDatasetConfig) -> bool:
    """Whether ``dataset_cfg`` has source images (``conditioning_data_dir``, a ``conditioning_column``, or generated
    ones: ``conditioning``)."""
    return (
        dataset_cfg.conditioning_data_dir is not None
        or _table_column(dataset_cfg) is not None
        or dataset_cfg.conditioning is not None
    )


def _table_column(dataset_cfg: FolderDatasetConfig) -> str | None:
    options = metadata_options(dataset_cfg)
    return options.conditioning_column if options is not None else None


def _source_root(dataset_cfg: FolderDatasetConfig) -> Path:
    folder = dataset_cfg.conditioning_data_dir
    return Path(folder if folder is not None else dataset_cfg.instance_data_dir).expanduser()


def list_images(root: Path) -> list[str]:
    """Relative POSIX paths of the images under ``root`` (recursive, hidden files and folders skipped)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS:
                found.append((Path(dirpath) / name).relative_to(root).as_posix())
    return sorted(found)


def find_sources(
    dataset_cfg: FolderDatasetConfig,
    image_paths: Iterable[str],
    table: CaptionTable | None = None,
    root: Path | None = None,
) -> dict[str, str]:
    """``{image path: absolute path of its source}`` for every image of the dataset.

    ``image_paths`` are relative to ``instance_data_dir``; ``table`` is the dataset's
    :class:`~simpletuner.data_backend.caption_files.CaptionTable` with ``conditioning_column``, or None to pair
    by file name in ``conditioning_data_dir`` (``root``: in that folder instead, e.g. the generated sources').

    Raises:
        ValueError: images without a source, sources without an image (folder pairing), two sources for one
            image name, or table sources that are not files: each named, with how to fix it.
    """
    images = list(image_paths)
    root = _source_root(dataset_cfg) if root is None else root
    where = f"dataset {dataset_cfg.id!r}"
    if table is not None and _table_column(dataset_cfg) is not None:
        return _table_sources(dataset_cfg, images, table, root, where)
    by_name: dict[str, list[str]] = {}
    for path in list_images(root):
        by_name.setdefault(strip_media_extension(path), []).append(path)
    ambiguous = [" and ".join(paths) for paths in by_name.values() if len(paths) > 1]
    if ambiguous:
        raise ValueError(
            f"{where}: conditioning_data_dir {root} holds several source images for one image name: "
            f"{listed(ambiguous)}. Keep one source per name"
        )
    names = {strip_media_extension(path): path for path in images}
    missing = [path for name, path in names.items() if name not in by_name]
    extra = [paths[0] for name, paths in by_name.items() if name not in names]
    problems = []
    if missing:
        problems.append(f"{len(missing)} image(s) have no source image in {root}: {listed(missing)}")
    if extra:
        problems.append(
            f"{len(extra)} source image(s) in {root} have no image in {dataset_cfg.instance_data_dir}: {listed(extra)}"
        )
    if problems:
        raise ValueError(
            f"{where} is a dataset of edit pairs, each image with the source image of the same relative path and "
            f"name (any image extension) in conditioning_data_dir, but " + "; ".join(problems) + ". Add the "
            "missing files, or move the unpaired ones out of both folders"
        )
    return {path: str(root / by_name[name][0]) for name, path in names.items()}


def _table_sources(
    dataset_cfg: FolderDatasetConfig, images: list[str], table: CaptionTable, root: Path, where: str
) -> dict[str, str]:
    column = _table_column(dataset_cfg)
    sources: dict[str, str] = {}
    missing: list[str] = []
    absent: list[str] = []
    for path in images:
        name = table.sources.get(table.identifier(path))
        if name is None:
            if table.captions.get(table.identifier(path)) is not None:  # rows without a caption are skipped anyway
                missing.append(path)
            continue
        full = Path(name).expanduser()
        full = full if full.is_absolute() else root / PurePosixPath(name)
        if not full.is_file():
            absent.append(f"{path} -> {full}")
            continue
        sources[path] = str(full)
    problems = []
    if missing:
        problems.append(f"{len(missing)} captioned image(s) have no `{column}` value: {listed(missing)}")
    if absent:
        problems.append(f"{len(absent)} source image(s) named there are not files: {listed(absent)}")
    if problems:
        raise ValueError(
            f"{where}: {table.strategy} file {table.source} pairs each image with the source image in column "
            f"`{column}` (a path relative to {root}, or absolute), but " + "; ".join(problems) + ". Fill the "
            "column, or fix the paths"
        )
    return sources


def source_size(source: str) -> tuple[int, int]:
    """``(width, height)`` of the source image file (header read, EXIF orientation applied).

    Raises:
        ValueError: not a readable image; OSError: the file cannot be read.
    """
    with open(source, "rb") as handle:
        return read_image_size(handle.read())


def aspect_problem(image_size: tuple[int, int], source: str, what: str = "source") -> str | None:
    """Why the ``what`` (an edit pair's source, a mask) at ``source`` cannot pair with an image of ``image_size``,
    or None: unreadable, or aspect ratios more than :data:`MAX_ASPECT_MISMATCH` apart (resizing it to the image
    would distort it)."""
    try:
        width, height = source_size(source)
    except (OSError, ValueError) as exc:
        return f"its {what} {source} cannot be read ({exc})"
    ratio = (width / height) / (image_size[0] / image_size[1])
    if abs(ratio - 1) > MAX_ASPECT_MISMATCH:
        return (
            f"its {what} {source} is {width}x{height}, the image {image_size[0]}x{image_size[1]}: aspect ratios "
            f"{abs(ratio - 1):.0%} apart (at most {MAX_ASPECT_MISMATCH:.0%}); crop the {what} to the image's shape"
        )
    return None


def source_pixels(sample: Sample) -> torch.Tensor:
    """The source image of ``sample`` as VAE input ``[3, H, W]`` in [-1, 1]: resized to the image's own
    size, then given the image's canvas, bucket and crop (:func:`prepare_image` with the sample's
    values), so it covers exactly the region the image's pixels do.

    Raises:
        ValueError: the file cannot be decoded; OSError: it cannot be read.
    """
    assert sample.source is not None, "only an edit pair's sample has a source"
    with open(sample.source, "rb") as handle:
        image = load_rgb(handle.read())
    width, height = sample.original_size
    if image.size != (width, height):
        image = image.resize((width, height), resample=_resample(image.size, (width, height)))
    return prepare_image(image, sample.bucket, sample.crop_style, sample.crop_seed, sample.canvas)[0]


def _resample(size: tuple[int, int], target: tuple[int, int]):
    from PIL import Image

    shrinking = target[0] * target[1] < size[0] * size[1]
    return Image.Resampling.LANCZOS if shrinking else Image.Resampling.BICUBIC


def pixels_to_image(pixels: torch.Tensor):
    """``[3, H, W]`` in [-1, 1] -> the RGB PIL image it was made from (exact for :func:`prepare_image`'s
    output, which is ``uint8 / 127.5 - 1``)."""
    from PIL import Image

    array = pixels.add(1.0).mul(127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(array, mode="RGB")


def source_identity(sample: Sample) -> dict[str, Any] | None:
    """What a cache entry made from ``sample``'s source depends on (its path, size and mtime), or None
    for a sample without one."""
    if sample.source is None:
        return None
    stat = os.stat(sample.source)
    return {"path": sample.source, "file": f"{stat.st_size}:{stat.st_mtime_ns}"}


class _ModelInputs(Protocol):
    """What :func:`check_model_inputs` reads of a model spec (data_backend sits below models)."""

    @property
    def family(self) -> str: ...
    @property
    def conditions_on_image(self) -> bool: ...
    @property
    def takes_validation_image(self) -> bool: ...
    @property
    def prompt_sees_source(self) -> bool: ...


def check_model_inputs(spec: _ModelInputs, config: TrainingConfig) -> None:
    """Refuse, before any dataset is scanned, a config whose data does not fit what ``spec``'s model takes:
    an edit model (``spec.conditions_on_image``) needs every trained dataset to name source images and cannot
    augment them (the source is cached with its image, and in the prompt embedding where the prompt sees it); any
    other model refuses source images; a
    model that renders from no image refuses ``validation_image``.

    Raises:
        ValueError: every problem at once, each with the key, the dataset and the fix.
    """
    from simpletuner.configuration.cache_paths import is_trained

    trained = [ds for ds in config.datasets or [] if is_trained(ds)]
    problems = []
    if spec.conditions_on_image:
        unpaired = [ds.id for ds in trained if not has_sources(ds)]
        if unpaired:
            problems.append(
                f"the model at {config.pretrained_model_name_or_path} trains on pairs of an image and its source "
                "(the image its caption edits, or a ControlNet's conditioning image), and dataset(s) "
                f"{', '.join(map(repr, unpaired))} name no sources. Give each a `conditioning_data_dir` (sources with "
                "the images' file names), a `conditioning_column` in its caption table, or a `conditioning` block "
                "that generates them"
            )
        if config.augmentations.is_enabled:
            where = "with the latents and the prompt embedding" if spec.prompt_sees_source else "with the latents"
            problems.append(
                f"augmentations are not supported with an edit model: the source image is cached {where} of each "
                "pair, unaugmented. Turn augmentations off"
            )
    else:
        paired = [ds.id for ds in trained if has_sources(ds)]
        if paired:
            problems.append(
                f"dataset(s) {', '.join(map(repr, paired))} name source images (conditioning_data_dir / "
                f"conditioning_column / conditioning), but model family {spec.family!r} at "
                f"{config.pretrained_model_name_or_path} is not an edit model and would not use them. Remove the key, "
                "point pretrained_model_name_or_path at an edit model's folder (a QwenImageEditPipeline or a "
                "FluxKontextPipeline), or set `controlnet: true` (sdxl, flux) to train a ControlNet on them"
            )
    if config.validation_image is not None and not spec.takes_validation_image:
        problems.append(
            f"validation_image is set, but the model at {config.pretrained_model_name_or_path} renders from no image "
            "(only edit models, ControlNets and image-to-video models do). Remove validation_image"
        )
    if problems:
        raise ValueError("\n".join(problems))
