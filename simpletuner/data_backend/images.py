"""Image decoding and the resize-and-crop that turns a file into a training tensor.

``read_image_size`` parses only the header (for bucketing thousands of files quickly);
``load_rgb`` decodes fully and normalises every Pillow mode to 8-bit RGB;
``prepare_image`` resizes to cover the bucket and crops to it, deterministically.
"""

from __future__ import annotations

import io
import logging
import random
import struct
from typing import Callable

import numpy as np
import torch
from PIL import Image, ImageOps

from simpletuner.data_backend.base import DataBackend, SupportsReadHead, SupportsReadTail
from simpletuner.data_backend.image_headers import EXIF_ORIENTATION_TAG as EXIF_ORIENTATION_TAG
from simpletuner.data_backend.image_headers import TAIL_BYTES, exif_orientation_of, fast_image_size, looks_cut_off

logger = logging.getLogger(__name__)

#: EXIF ``Orientation`` (:data:`EXIF_ORIENTATION_TAG`) values 5-8 rotate by 90 degrees: width and height swap.
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})

#: What Pillow raises on broken or hostile files (beyond the OSError family).
_DECODE_ERRORS = (OSError, SyntaxError, EOFError, struct.error, ValueError, IndexError, Image.DecompressionBombError)

#: Background that transparent pixels are composited onto.
_BACKGROUND = (255, 255, 255)

CROP_STYLES = ("center", "random", "corner")

#: Bytes read first to parse a JPEG/PNG header (a JPEG's EXIF segment is at most 64 KiB);
#: the whole file is read only if that fails. WebP keeps EXIF at the end: always read whole.
HEADER_BYTES = 256 * 1024
_PREFIX_PARSABLE = frozenset({".jpg", ".jpeg", ".png"})

#: ``prepare_image`` resamples only the crop window when the resized image would be more than
#: this many times the bucket's area (only images far more elongated than the 4:1 buckets).
MAX_RESIZE_OVERSHOOT = 16


def _exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation recorded in the header, or 1 (none); never decodes pixels.

    ``Image.getexif`` would make PNG load the whole file to look for a late eXIf chunk, so
    only the EXIF block Pillow found while parsing the header is read.
    """
    return exif_orientation_of(image.info.get("exif"))


def read_image_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` of an encoded image as displayed, from its header only.

    EXIF orientations 5-8 (rotated by 90 degrees) swap width and height, matching what
    :func:`load_rgb` returns. PNG and JPEG headers are parsed directly
    (:func:`~simpletuner.data_backend.image_headers.fast_image_size`); anything that parser cannot
    vouch for is opened with Pillow (:func:`read_image_size_pil`), with the same result.

    Raises:
        ValueError: ``data`` is empty, not an image Pillow recognises, or its header is cut off.
    """
    fast = fast_image_size(data)
    if fast is None:
        return read_image_size_pil(data)
    width, height, orientation = fast
    if orientation in _SWAPPING_ORIENTATIONS:
        return height, width
    return width, height


def read_image_size_pil(data: bytes) -> tuple[int, int]:
    """:func:`read_image_size` with Pillow's ``Image.open`` for every format (the reference the
    header parser is tested against)."""
    if not data:
        raise ValueError("empty file (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            orientation = _exif_orientation(image)
    except Image.UnidentifiedImageError:
        raise ValueError("not a recognised image (unknown format or header cut off)") from None
    except _DECODE_ERRORS as exc:
        raise ValueError(f"unreadable image header: {exc}") from None
    if width <= 0 or height <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    if orientation in _SWAPPING_ORIENTATIONS:
        return height, width
    return width, height


def image_size_of(backend: DataBackend, path: str) -> tuple[int, int]:
    """:func:`read_image_size` of the file ``path`` of ``backend``: reads only a prefix where the
    backend can (:class:`SupportsReadHead`) and the format allows, the whole file otherwise."""
    return image_size_reader(backend)(path)


def image_size_reader(backend: DataBackend) -> Callable[[str], tuple[int, int]]:
    """:func:`image_size_of` for many files of one ``backend`` (what it can read is checked once).

    It also checks that the file was not cut off, from its last bytes
    (:func:`~simpletuner.data_backend.image_headers.looks_cut_off`: those of the header read when that holds
    the whole file, else a read of the end where the backend offers one, :class:`SupportsReadTail`); a file
    that looks cut off is decoded, and a ValueError says why it does not decode. A file that does not end
    like a whole one but decodes (data after its end) is fine.
    """
    read_head = backend.read_head if isinstance(backend, SupportsReadHead) else None
    read_tail = backend.read_tail if isinstance(backend, SupportsReadTail) else None

    def size_of(path: str) -> tuple[int, int]:
        if read_head is not None and _suffix(path).lower() in _PREFIX_PARSABLE:
            head = read_head(path, HEADER_BYTES)
            if not head:
                raise ValueError("empty file (0 bytes)")
            is_whole = len(head) < HEADER_BYTES
            try:
                size = read_image_size(head)
            except ValueError:
                if is_whole:
                    raise  # that was the whole file
            else:
                tail = head if is_whole else read_tail(path, TAIL_BYTES) if read_tail is not None else None
                if tail is not None and looks_cut_off(head, tail):
                    load_rgb(head if is_whole else backend.read(path))  # the decode decides (raises why)
                return size
        data = backend.read(path)
        size = read_image_size(data)
        if looks_cut_off(data, data, len(data)):
            load_rgb(data)
        return size

    return size_of


def _suffix(path: str) -> str:
    """``PurePosixPath(path).suffix``, without building a path object."""
    name = path[path.rfind("/") + 1 :]
    dot = name.rfind(".")
    return name[dot:] if 0 < dot < len(name) - 1 else ""


def load_rgb(data: bytes) -> Image.Image:
    """Decode ``data`` fully, apply its EXIF orientation and return an 8-bit RGB image.

    Transparency (RGBA, LA, PA, palette or single-colour transparency) is composited on
    white; CMYK, YCbCr, L and 1-bit convert directly; 16/32-bit integer images
    (``I;16*``, ``I``) are taken as 16-bit data and scaled to 8 bit; float images (``F``)
    as 0..1 when their maximum is at most 1, else as 0..255.

    Raises:
        ValueError: ``data`` cannot be decoded (empty, truncated, not an image).
    """
    if not data:
        raise ValueError("empty file (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as opened:
            opened.load()
            image = ImageOps.exif_transpose(opened)
    except Image.UnidentifiedImageError:
        raise ValueError("not a recognised image (unknown format or header cut off)") from None
    except _DECODE_ERRORS as exc:
        raise ValueError(f"cannot decode image: {exc}") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert a decoded image of any Pillow mode to 8-bit RGB (see :func:`load_rgb`)."""
    mode = image.mode
    if mode == "RGB" and "transparency" not in image.info:
        return image
    if mode.startswith("I") or mode == "F":
        return _high_depth_to_rgb(image)
    has_alpha = mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in image.info
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, _BACKGROUND + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _high_depth_to_rgb(image: Image.Image) -> Image.Image:
    """Scale a 16/32-bit integer or float single-channel image to 8-bit RGB."""
    if image.mode == "F":
        values = np.asarray(image, dtype=np.float32)
        scale = 255.0 if values.size and float(values.max()) <= 1.0 else 1.0
        grey = np.clip(values * scale, 0, 255)
    else:
        # ``I;16``, ``I;16B``, ``I;16L`` and ``I`` (how Pillow opens 16-bit PNG/TIFF).
        values = np.asarray(image.convert("I") if image.mode != "I" else image, dtype=np.float64)
        grey = np.clip(values, 0, 65535) / 257.0
    grey8 = np.rint(grey).astype(np.uint8)
    return Image.fromarray(np.stack([grey8] * 3, axis=-1))


def prepare_image(
    image: Image.Image,
    bucket: tuple[int, int],
    crop_style: str,
    crop_seed: int,
    canvas: tuple[int, int] | None = None,
    resample: Image.Resampling | None = None,
) -> tuple[torch.Tensor, dict]:
    """Resize ``image`` to cover ``bucket`` (keeping its aspect), crop to it, make a tensor.

    ``crop_style``: ``"center"``, ``"random"`` (offset from ``random.Random(crop_seed)``: same seed, same pixels)
    or ``"corner"`` (top left). ``canvas`` ``(w, h)``: resize to this instead (a large image's downsample,
    :attr:`~simpletuner.data_backend.geometry.CropPlan.canvas`; a side below the bucket's is raised). ``resample``:
    the Pillow filter (None: ``LANCZOS`` to shrink, ``BICUBIC`` to enlarge; a mask takes ``BOX``).
    Returns ``(pixels, info)``: float32 ``[3, H, W]`` in ``[-1, 1]`` with ``(W, H) == bucket``; ``info`` holds
    ``crop_top`` / ``crop_left`` (in the resized image's pixels), ``original_size`` (after EXIF orientation for
    :func:`load_rgb`'s), ``resized_size`` and ``target_size``.
    Raises ValueError for an unknown ``crop_style`` or a non-positive bucket side.
    """
    if crop_style not in CROP_STYLES:
        raise ValueError(f"crop_style {crop_style!r} is not one of {', '.join(CROP_STYLES)}")
    target_w, target_h = int(bucket[0]), int(bucket[1])
    if target_w <= 0 or target_h <= 0:
        raise ValueError(f"bucket sides must be positive, got {target_w}x{target_h}")
    image = to_rgb(image)
    width, height = image.size
    if canvas is None:
        scale = max(target_w / width, target_h / height)
        # ``max`` guards against rounding a side to one pixel short of the bucket.
        resized_w = max(target_w, round(width * scale))
        resized_h = max(target_h, round(height * scale))
    else:
        resized_w, resized_h = max(target_w, int(canvas[0])), max(target_h, int(canvas[1]))
        scale = max(resized_w / width, resized_h / height)
    if crop_style == "center":
        left = (resized_w - target_w) // 2
        top = (resized_h - target_h) // 2
    elif crop_style == "corner":
        left = top = 0
    else:
        rng = random.Random(crop_seed)
        left = rng.randint(0, resized_w - target_w)
        top = rng.randint(0, resized_h - target_h)
    if resample is None:
        resample = Image.Resampling.LANCZOS if scale < 1 else Image.Resampling.BICUBIC
    if resized_w * resized_h > MAX_RESIZE_OVERSHOOT * target_w * target_h:
        # A strip far beyond MAX_ASPECT_RATIO: resizing all of it would build a huge
        # intermediate (a 4000x1 strip in a 2048x512 bucket: ~1 G pixels), so resample only
        # the source window that maps onto the crop.
        sx, sy = width / resized_w, height / resized_h
        box = (left * sx, top * sy, (left + target_w) * sx, (top + target_h) * sy)
        cropped = image.resize((target_w, target_h), resample=resample, box=box)
    else:
        if (resized_w, resized_h) != (width, height):
            image = image.resize((resized_w, resized_h), resample=resample, reducing_gap=3.0 if scale < 1 else None)
        cropped = image.crop((left, top, left + target_w, top + target_h))
    array = np.asarray(cropped, dtype=np.uint8)
    pixels = torch.from_numpy(array.copy()).permute(2, 0, 1).to(torch.float32).div_(127.5).sub_(1.0)
    info = {
        "crop_top": top,
        "crop_left": left,
        "original_size": (width, height),
        "resized_size": (resized_w, resized_h),
        "target_size": (target_w, target_h),
    }
    return pixels.contiguous(), info
