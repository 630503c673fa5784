"""Masked loss: each training image with a mask image of the same relative path and name in ``mask_data_dir``
(SimpleTuner's ``conditioning_type: mask`` / ``segmentation`` dataset).

:func:`find_masks` pairs them before anything is cached and names every image without a mask;
:func:`mask_pixels` cuts a mask as its image is cut (resized to the image, then the image's canvas, bucket
and crop), :func:`augment_mask` gives it the image's augmentation crop and flip (never its colour), and
:func:`latent_mask` averages it over each latent pixel: the per-pixel loss weight cached with the latents
(:data:`MASK_KEY`). Meaning, sources and what differs from SimpleTuner: documentation/MODEL_FAMILIES.md,
"Masked loss".
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.nn.functional as F

from simpletuner.data_backend.augment import AugmentParams, jitter_crop
from simpletuner.data_backend.caption_files import strip_media_extension
from simpletuner.data_backend.images import load_rgb, prepare_image
from simpletuner.data_backend.pairs import list_images, listed

if TYPE_CHECKING:
    from simpletuner.configuration.dataset_sections import FolderDatasetConfig
    from simpletuner.data_backend.metadata import Sample

#: The tensor a latent entry holds beside ``latents`` for a masked sample, and the batch conditioning's key:
#: ``[1, h, w]`` float32 per sample, the loss weight of each latent pixel in [0, 1].
MASK_KEY = "loss_mask"
#: Part of the cache key of a masked latent entry; bump when the mask arithmetic changes.
MASK_VERSION = 1
#: ``mask_type`` values: ``mask`` weights by the mask's first (red) channel, ``segmentation`` keeps every latent
#: pixel any non-black mask pixel falls in (common.py:6409-6424 at SIMPLETUNER_COMMIT).
MASK_TYPES = ("mask", "segmentation")


def has_masks(dataset_cfg: FolderDatasetConfig) -> bool:
    """Whether ``dataset_cfg`` names a folder of masks (``mask_data_dir``)."""
    return getattr(dataset_cfg, "mask_data_dir", None) is not None


def find_masks(dataset_cfg: FolderDatasetConfig, image_paths: Iterable[str]) -> dict[str, str]:
    """``{image path: absolute path of its mask}`` for every image of the dataset; ``image_paths`` are relative
    to ``instance_data_dir``. A mask pairs with the image of the same relative path and name (any image
    extension); masks without an image are left unused.

    Raises:
        ValueError: images without a mask (each named), or two masks for one image name.
    """
    assert dataset_cfg.mask_data_dir is not None, "only a dataset with mask_data_dir has masks"
    root = Path(dataset_cfg.mask_data_dir).expanduser()
    by_name: dict[str, list[str]] = {}
    for path in list_images(root):
        by_name.setdefault(strip_media_extension(path), []).append(path)
    where = f"dataset {dataset_cfg.id!r}"
    ambiguous = [" and ".join(paths) for paths in by_name.values() if len(paths) > 1]
    if ambiguous:
        raise ValueError(
            f"{where}: mask_data_dir {root} holds several masks for one image name: {listed(ambiguous)}. Keep one "
            "mask per name"
        )
    names = {path: strip_media_extension(path) for path in image_paths}
    missing = [path for path, name in names.items() if name not in by_name]
    if missing:
        raise ValueError(
            f"{where} trains with masked loss, each image with the mask of the same relative path and name (any "
            f"image extension) in mask_data_dir {root}, but {len(missing)} image(s) have no mask there: "
            f"{listed(missing)}. Add their masks (an all-white mask keeps the whole image), or move those images out"
        )
    return {path: str(root / by_name[name][0]) for path, name in names.items()}


def mask_identity(sample: Sample) -> dict[str, Any] | None:
    """What a latent entry of ``sample`` depends on through its mask: the file (path, size and mtime), how it
    is read (``mask_type``) and the arithmetic's version; None for a sample without a mask."""
    if sample.mask is None:
        return None
    stat = os.stat(sample.mask)
    return {
        "path": sample.mask,
        "file": f"{stat.st_size}:{stat.st_mtime_ns}",
        "type": sample.mask_type,
        "version": MASK_VERSION,
    }


def mask_file_bytes(sample: Sample) -> bytes:
    """The bytes of ``sample``'s mask file (for the content hash stored beside its latent).

    Raises:
        OSError: the file cannot be read.
    """
    assert sample.mask is not None, "only a masked sample has a mask file"
    with open(sample.mask, "rb") as handle:
        return handle.read()


def mask_pixels(sample: Sample) -> torch.Tensor:
    """The mask of ``sample`` as ``[1, H, W]`` weights in [0, 1] at the sample's bucket: the mask file resized to
    the image's own size, then given the image's canvas, bucket and crop (:func:`prepare_image` with the sample's
    values), both resizes averaging areas (``BOX``) so a mask edge never rings. ``mask_type: mask`` reads the red
    channel (a grey mask: its grey), white 1 and black 0; ``segmentation`` the mean of the three channels.

    Raises:
        ValueError: the file cannot be decoded; OSError: it cannot be read.
    """
    from PIL import Image

    assert sample.mask is not None, "only a masked sample has a mask"
    with open(sample.mask, "rb") as handle:
        image = load_rgb(handle.read())
    box = Image.Resampling.BOX
    if image.size != sample.original_size:
        image = image.resize(sample.original_size, resample=box)
    pixels, _ = prepare_image(image, sample.bucket, sample.crop_style, sample.crop_seed, sample.canvas, resample=box)
    grey = pixels[:1] if sample.mask_type == "mask" else pixels.mean(dim=0, keepdim=True)
    return grey.add(1.0).mul(0.5).clamp(0.0, 1.0)


def augment_mask(mask: torch.Tensor, params: AugmentParams) -> torch.Tensor:
    """``mask`` ``[1, H, W]`` given the crop jitter and flip ``params`` give its image
    (:func:`~simpletuner.data_backend.augment.apply_params`), in the same order; colour changes leave it alone."""
    out = jitter_crop(mask, params)
    return torch.flip(out, dims=[-1]) if params.flip else out


def latent_mask(masks: torch.Tensor, latent_size: tuple[int, int], binary: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, 1, H, W]`` pixel weights -> ``[B, 1, h, w]`` latent-pixel weights: each the mean of the pixels it
    covers (``area``, as SimpleTuner's ``interpolate(mode="area")``). ``binary`` ([B] bool): rows read as
    ``segmentation``, whose weight is 1 where any covered pixel is above 0, else 0."""
    weights = F.interpolate(masks.float(), size=tuple(latent_size), mode="area")
    if binary is not None and bool(binary.any()):
        rows = binary.view(-1, 1, 1, 1).to(weights.device)
        weights = torch.where(rows, (weights > 0).to(weights.dtype), weights)
    return weights


def mask_draw(seed: int, epoch: int, position: int) -> float:
    """A uniform draw in [0, 1) for micro-batch ``position`` of ``epoch``: whether a ``segmentation`` batch uses
    its mask under ``masked_loss_probability`` (sha256 of the values: the same on every process and on resume)."""
    text = f"masked-loss\x00{seed}\x00{epoch}\x00{position}"
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64
