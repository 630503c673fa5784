"""The demo's files: a tiny model, a synthetic captioned dataset of shapes, its config, the before | after sheet.

Pure writers (no training): `simpletuner demo`, the web UI, tests and benchmarks use them.
"""

from __future__ import annotations

import io
import random
import re
from pathlib import Path

import orjson
from PIL import Image, ImageDraw, ImageFont

from simpletuner.testing.zoo import TINY_SD_ALIGNMENT, TINY_SD_RESOLUTION, write_tiny_model

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 205, 40)}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15)}
#: The demo's validation prompt: one of the dataset's captions.
VALIDATION_PROMPT = "a red circle on a white background"


def draw_shape(
    shape: str,
    colour: tuple[int, int, int],
    background: tuple[int, int, int],
    size: tuple[int, int],
    rng: random.Random,
) -> Image.Image:
    """One image of a filled shape at a random place and scale."""
    w, h = size
    img = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(img)
    r = rng.uniform(0.2, 0.35) * min(w, h)
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    return img


def write_if_changed(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` unless the file already holds exactly these bytes; True if written.

    A re-run of the demo then leaves its files (and their mtimes) alone, so the latent cache,
    whose keys cover each image's mtime and size, is hit instead of filled again.
    """
    try:
        if path.stat().st_size == len(data) and path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    path.write_bytes(data)
    return True


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_shapes_dataset(
    out_dir: str | Path, num_images: int = 24, seed: int = 0, sizes=((64, 64), (96, 64), (64, 96))
) -> Path:
    """PNG images of coloured shapes, each with a same-named .txt caption describing it.

    Files that already hold the same content are left untouched (see :func:`write_if_changed`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(num_images):
        shape = SHAPES[i % len(SHAPES)]
        colour = list(COLOURS)[(i // len(SHAPES)) % len(COLOURS)]
        bg = rng.choice(list(BACKGROUNDS))
        size = sizes[i % len(sizes)]
        image = draw_shape(shape, COLOURS[colour], BACKGROUNDS[bg], size, rng)
        write_if_changed(out / f"{i:03d}.png", _png_bytes(image))
        write_if_changed(out / f"{i:03d}.txt", f"a {colour} {shape} on a {bg} background".encode())
    return out


def write_edit_pairs(
    out_dir: str | Path, num_pairs: int = 8, seed: int = 0, sizes=((64, 64), (96, 64), (64, 96))
) -> tuple[Path, Path]:
    """Edit pairs of coloured shapes: ``out_dir/images`` holds each edited image with its instruction as a
    same-named .txt caption ("make the circle blue"), ``out_dir/sources`` the image before the edit (the same
    shape, place and background in another colour) under the same file name. Returns ``(images, sources)``,
    the dataset's ``instance_data_dir`` and ``conditioning_data_dir``. Files already equal are left untouched."""
    out = Path(out_dir)
    images, sources = out / "images", out / "sources"
    images.mkdir(parents=True, exist_ok=True)
    sources.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = list(COLOURS)
    for i in range(num_pairs):
        shape = SHAPES[i % len(SHAPES)]
        before = names[(i // len(SHAPES)) % len(names)]
        after = names[(names.index(before) + 1 + i % (len(names) - 1)) % len(names)]
        bg = rng.choice(list(BACKGROUNDS))
        size = sizes[i % len(sizes)]
        state = rng.getstate()  # the same draws: the same shape at the same place in both images
        write_if_changed(
            sources / f"{i:03d}.png", _png_bytes(draw_shape(shape, COLOURS[before], BACKGROUNDS[bg], size, rng))
        )
        rng.setstate(state)
        write_if_changed(
            images / f"{i:03d}.png", _png_bytes(draw_shape(shape, COLOURS[after], BACKGROUNDS[bg], size, rng))
        )
        write_if_changed(images / f"{i:03d}.txt", f"make the {shape} {after}".encode())
    return images, sources


def write_demo(root: str | Path, max_train_steps: int = 200, num_images: int = 24) -> Path:
    """Write model, data and config under ``root``; returns the config path.

    Re-running it over an existing ``root`` rewrites nothing that is already there and equal.
    """
    root = Path(root).resolve()
    model = root / "model"
    if not (model / "model_index.json").exists():
        write_tiny_model("sd", model)
    data = write_shapes_dataset(root / "data", num_images=num_images)
    config = {
        "pretrained_model_name_or_path": str(model),
        "model_family": "sd",
        "output_dir": str(root / "output"),
        "resolution": TINY_SD_RESOLUTION,
        "aspect_bucket_alignment": TINY_SD_ALIGNMENT,
        "train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_train_steps": max_train_steps,
        "learning_rate": 5e-3,
        "lr_scheduler": "constant",
        "training_type": "lora",
        "lora_rank": 16,
        "checkpointing_steps": max(max_train_steps // 2, 1),
        "checkpoints_total_limit": 2,
        "resume_from_checkpoint": "latest",  # `train --config demo_run/config.json --set max_train_steps=N` extends it
        "validation_prompt": VALIDATION_PROMPT,
        "validation_num_inference_steps": 10,
        "num_validation_images": 2,
        "logging_steps": 20,
        "seed": 42,
        "cache_config": {"cache_dir": str(root / "cache")},
        "datasets": [{"id": "shapes", "type": "local", "instance_data_dir": str(data), "caption_strategy": "textfile"}],
    }
    path = root / "config.json"
    write_if_changed(path, orjson.dumps(config, option=orjson.OPT_INDENT_2))
    return path


_VALIDATION_NAME = re.compile(r"step_(\d+)_(\d+)\.png")


def write_before_after(output_dir: str | Path, prompt: str | None = None, min_tile: int = 192) -> Path | None:
    """Put the first and the last validation images side by side: ``output_dir/before_after.png``.

    One row per validation image index: the image from the earliest validation step (before
    training) next to the one from the latest step. Validation seeds its generator the same way
    at every step, so the two differ only by the training in between. Small images are scaled up
    (nearest neighbour) to at least ``min_tile`` pixels and each column is labelled with its step.
    Returns None when ``output_dir/validation`` holds fewer than two steps.
    """
    output_dir = Path(output_dir)
    by_step: dict[int, dict[int, Path]] = {}
    for path in (output_dir / "validation").glob("step_*_*.png"):
        match = _VALIDATION_NAME.fullmatch(path.name)
        if match:
            by_step.setdefault(int(match[1]), {})[int(match[2])] = path
    if len(by_step) < 2:
        return None
    first, last = min(by_step), max(by_step)
    indices = sorted(set(by_step[first]) & set(by_step[last]))
    if not indices:
        return None
    pairs = [
        (Image.open(by_step[first][i]).convert("RGB"), Image.open(by_step[last][i]).convert("RGB")) for i in indices
    ]
    w, h = pairs[0][0].size
    scale = max(1, -(-min_tile // max(w, h)))
    tw, th = w * scale, h * scale
    font = ImageFont.load_default()
    label_h, gap = 18, 4
    footer_h = label_h if prompt else 0
    sheet = Image.new("RGB", (2 * tw + gap, label_h + len(pairs) * (th + gap) - gap + footer_h), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for col, text in enumerate((f"before (step {first})", f"after (step {last})")):
        draw.text((col * (tw + gap) + 4, 3), text, fill=(0, 0, 0), font=font)
    for row, pair in enumerate(pairs):
        for col, img in enumerate(pair):
            sheet.paste(img.resize((tw, th), Image.Resampling.NEAREST), (col * (tw + gap), label_h + row * (th + gap)))
    if prompt:
        draw.text((4, sheet.height - footer_h + 3), f"prompt: {prompt}", fill=(0, 0, 0), font=font)
    path = output_dir / "before_after.png"
    sheet.save(path)
    return path
