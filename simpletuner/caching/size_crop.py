"""Each image's size before resizing and its crop offset, stored with its latent: SDXL's size and crop
micro-conditioning (the first four of its six ``add_time_ids``).

A spec with ``conditions_on_size_crop`` gets, beside ``latents``, a float32 :data:`SIZE_CROP` tensor
``[original_h, original_w, crop_top, crop_left]`` as diffusers' ``train_text_to_image_lora_sdxl.py`` gives
them, in the coordinates of the image the model sees (after a zoom or mirror). Its presence is part of the
latent's key (:data:`SIZE_CROP_VERSION`): an entry without it is a miss, never read as zeros.
Sources and rounding: documentation/MODEL_FAMILIES.md, "SDXL: size and crop micro-conditioning".
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
