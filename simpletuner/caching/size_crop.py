"""Each image's size before resizing and its crop offset, stored with its latent: SDXL's size and crop
micro-conditioning (the first four of its six ``add_time_ids``).

A model whose spec sets ``conditions_on_size_crop`` gets, in every latent entry
beside ``latents``, a float32 tensor :data:`SIZE_CROP` ``[original_h, original_w, crop_top, crop_left]``,
with the meaning diffusers' ``examples/text_to_image/train_text_to_image_lora_sdxl.py`` gives them
(``preprocess_train``, its ``original_sizes`` and ``crop_top_lefts``):

- ``original_h, original_w``: the image as decoded, after its EXIF orientation, before any resize;
- ``crop_top, crop_left``: where the bucket's window starts, in the pixels of the image resized to cover
  the bucket (:func:`~simpletuner.data_backend.images.prepare_image`), i.e. of the image whose crop the
  model sees. An augmentation that zooms (``crop_jitter``) or mirrors (``flip_probability``) the window
  changes that image, so the offset is given in its coordinates: the window's offset in the resized image
  enlarged by the zoom, and a mirrored window's offset from the left of the mirrored image (as the script's
  ``random_flip``, which flips before it crops, reports it).

These are per-image facts, like the crop, so their presence is part of the latent's key
(:data:`SIZE_CROP_VERSION`, :func:`~simpletuner.caching.vae_cache.sample_latent_key`): an entry written
without them (by an older version) is a miss and is encoded again, never read as zeros. Families that do
not condition on them store and key nothing new.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from simpletuner.data_backend.augment import AugmentParams, crop_window

#: The tensor a latent entry holds beside ``latents`` for a model conditioned on size and crop.
SIZE_CROP = "size_crop"

#: Part of the latent key of entries that hold :data:`SIZE_CROP`; bump when its definition changes.
SIZE_CROP_VERSION = 1

#: Bytes of one entry's :data:`SIZE_CROP` tensor (four float32).
SIZE_CROP_BYTES = 16

SizeCrop = tuple[int, int, int, int]


def size_crop_of(info: Mapping[str, Any], params: AugmentParams | None = None) -> SizeCrop:
    """``(original_h, original_w, crop_top, crop_left)`` of one prepared image: ``info`` is what
    :func:`~simpletuner.data_backend.images.prepare_image` reports, ``params`` the augmentation applied to its
    pixels afterwards (None: none). See the module docstring for the coordinates."""
    original_w, original_h = info["original_size"]
    top, left = int(info["crop_top"]), int(info["crop_left"])
    if params is None:
        return int(original_h), int(original_w), top, left
    width, height = info["target_size"]
    resized_w = info["resized_size"][0]
    scale_x = 1.0
    if params.crop_scale != 1.0:  # the window is enlarged and cut again: offsets in the enlarged image
        scaled_h, scaled_w, jitter_top, jitter_left = crop_window(height, width, params)
        scale_x = scaled_w / width
        top = round(top * scaled_h / height) + jitter_top
        left = round(left * scale_x) + jitter_left
    if params.flip:  # the mirrored window's offset from the mirrored image's left edge
        left = max(0, round(resized_w * scale_x) - left - width)
    return int(original_h), int(original_w), top, left


def size_crop_tensor(values: list[SizeCrop]) -> torch.Tensor:
    """``[N, 4]`` float32 of ``values`` (exact: sides below 2**24 pixels)."""
    return torch.tensor(values, dtype=torch.float32).reshape(len(values), 4)
