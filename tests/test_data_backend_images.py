"""Header sizes, decoding of every Pillow mode to RGB, and the resize-and-crop."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from simpletuner.data_backend import load_rgb, prepare_image, read_image_size


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def gradient(size=(40, 24)) -> Image.Image:
    w, h = size
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :].repeat(h, 0)
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None].repeat(w, 1)
    return Image.fromarray(np.stack([x, y, 255 - x], -1).astype(np.uint8), "RGB")


def with_orientation(image: Image.Image, fmt: str, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(image, fmt, exif=exif.tobytes())


def _i16_png() -> bytes:
    values = np.linspace(0, 65535, 30 * 20).reshape(20, 30).astype(np.uint16)
    assert Image.fromarray(values).mode == "I;16"
    return encode(Image.fromarray(values), "PNG")


ENCODED = {
    "rgb_png": lambda: encode(gradient(), "PNG"),
    "rgb_jpeg": lambda: encode(gradient((33, 17)), "JPEG"),
    "rgb_webp": lambda: encode(gradient((50, 20)), "WEBP"),
    "rgba_png": lambda: encode(gradient().convert("RGBA"), "PNG"),
    "p_png": lambda: encode(gradient().convert("P"), "PNG"),
    "l_png": lambda: encode(gradient().convert("L"), "PNG"),
    "la_png": lambda: encode(gradient().convert("LA"), "PNG"),
    "cmyk_jpeg": lambda: encode(gradient((30, 45)).convert("CMYK"), "JPEG"),
    "i16_png": _i16_png,
    "one_bit_png": lambda: encode(gradient().convert("1"), "PNG"),
}


@pytest.mark.parametrize("name", sorted(ENCODED))
def test_header_size_matches_decode_and_rgb_for_every_mode(name):
    data = ENCODED[name]()
    decoded = Image.open(io.BytesIO(data))
    decoded.load()
    assert read_image_size(data) == decoded.size
    rgb = load_rgb(data)
    assert rgb.mode == "RGB"
    assert rgb.size == decoded.size


def test_i16_scaled_to_8_bit():
    rgb = np.asarray(load_rgb(_i16_png()))
    assert rgb[0, 0].tolist() == [0, 0, 0]
    assert rgb[-1, -1].tolist() == [255, 255, 255]
    assert 100 < rgb[10, 15, 0] < 155  # mid-grey, not clipped to white


def test_transparency_is_composited_on_white():
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))
    rgba.putpixel((0, 0), (255, 0, 0, 255))
    rgb = np.asarray(load_rgb(encode(rgba, "PNG")))
    assert rgb[0, 0].tolist() == [255, 0, 0]
    assert rgb[4, 4].tolist() == [255, 255, 255]

    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([0, 0, 0, 0, 255, 0])
    palette.putpixel((1, 1), 1)
    rgb = np.asarray(load_rgb(encode(palette, "PNG", transparency=0)))
    assert rgb[0, 0].tolist() == [255, 255, 255]
    assert rgb[1, 1].tolist() == [0, 255, 0]


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation,rotated", [(1, False), (3, False), (6, True), (8, True)])
def test_exif_orientation_swaps_size_without_decoding(fmt, orientation, rotated):
    data = with_orientation(gradient((40, 20)), fmt, orientation)
    expected = (20, 40) if rotated else (40, 20)
    assert read_image_size(data) == expected
    assert load_rgb(data).size == expected


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"", "empty"),
        (encode(gradient(), "PNG")[:20], "header"),
        (b"this is plain text, not a png", "not a recognised image"),
    ],
)
def test_bad_data_raises_value_error(data, reason):
    with pytest.raises(ValueError, match=reason):
        read_image_size(data)
    with pytest.raises(ValueError):
        load_rgb(data)


def test_truncated_body_fails_to_decode():
    data = encode(gradient((200, 200)), "PNG")
    assert read_image_size(data[: len(data) // 2]) == (200, 200)  # header is intact
    with pytest.raises(ValueError, match="cannot decode"):
        load_rgb(data[: len(data) // 2])


@pytest.mark.parametrize(
    "size,bucket", [((40, 24), (32, 16)), ((24, 40), (16, 32)), ((10, 10), (32, 32)), ((300, 100), (64, 16))]
)
@pytest.mark.parametrize("style", ["center", "random"])
def test_prepare_image_shape_range_and_info(size, bucket, style):
    pixels, info = prepare_image(gradient(size), bucket, style, crop_seed=7)
    assert pixels.dtype == torch.float32
    assert tuple(pixels.shape) == (3, bucket[1], bucket[0])
    assert pixels.min() >= -1.0 and pixels.max() <= 1.0
    assert pixels.max() - pixels.min() > 0.5  # a gradient, not a constant
    assert info["original_size"] == size
    assert info["target_size"] == bucket
    assert info["crop_top"] >= 0 and info["crop_left"] >= 0


def test_center_crop_is_centred_and_exact_fit_not_cropped():
    _, info = prepare_image(gradient((64, 32)), (32, 32), "center", 0)
    assert (info["crop_left"], info["crop_top"]) == (16, 0)
    pixels, info = prepare_image(gradient((32, 16)), (32, 16), "center", 0)
    assert (info["crop_left"], info["crop_top"]) == (0, 0)
    expected = torch.from_numpy(np.array(gradient((32, 16)))).permute(2, 0, 1).float() / 127.5 - 1
    assert torch.allclose(pixels, expected)


def test_random_crop_is_deterministic_per_seed():
    image = gradient((400, 100))
    first, info_a = prepare_image(image, (64, 64), "random", 1234)
    again, info_b = prepare_image(image, (64, 64), "random", 1234)
    assert torch.equal(first, again) and info_a == info_b
    offsets = {prepare_image(image, (64, 64), "random", seed)[1]["crop_left"] for seed in range(20)}
    assert len(offsets) > 5  # different seeds move the crop


def test_prepare_image_rejects_unknown_crop_style():
    with pytest.raises(ValueError, match="crop_style 'face'"):
        prepare_image(gradient(), (16, 16), "face", 0)
