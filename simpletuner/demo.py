"""The built-in demo: a tiny model, a synthetic captioned dataset of shapes, a config, a run."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
from PIL import Image, ImageDraw

from simpletuner.models.zoo import TINY_SD_ALIGNMENT, TINY_SD_RESOLUTION, write_tiny_model

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 205, 40)}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15)}


def draw_shape(shape: str, colour: tuple[int, int, int], background: tuple[int, int, int], size: tuple[int, int], rng: random.Random) -> Image.Image:
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


def write_shapes_dataset(out_dir: str | Path, num_images: int = 24, seed: int = 0, sizes=((64, 64), (96, 64), (64, 96))) -> Path:
    """PNG images of coloured shapes, each with a same-named .txt caption describing it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(num_images):
        shape = SHAPES[i % len(SHAPES)]
        colour = list(COLOURS)[(i // len(SHAPES)) % len(COLOURS)]
        bg = rng.choice(list(BACKGROUNDS))
        size = sizes[i % len(sizes)]
        draw_shape(shape, COLOURS[colour], BACKGROUNDS[bg], size, rng).save(out / f"{i:03d}.png")
        (out / f"{i:03d}.txt").write_text(f"a {colour} {shape} on a {bg} background")
    return out


def write_demo(root: str | Path, max_train_steps: int = 200, num_images: int = 24) -> Path:
    """Write model, data and config under ``root``; returns the config path."""
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
        "validation_prompt": "a red circle on a white background",
        "validation_num_inference_steps": 10,
        "num_validation_images": 2,
        "logging_steps": 20,
        "seed": 42,
        "cache_config": {"cache_dir": str(root / "cache")},
        "datasets": [{"id": "shapes", "type": "local", "instance_data_dir": str(data), "caption_strategy": "textfile"}],
    }
    path = root / "config.json"
    path.write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2))
    return path
