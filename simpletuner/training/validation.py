"""Sample images with the model being trained, on the main process."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@torch.no_grad()
def generate_validation_images(spec, denoiser, vae, text_encoders, config, step: int, out_dir: Path, trackers=()) -> list[Path]:
    """Render ``num_validation_images`` for ``validation_prompt`` and save them as PNGs."""
    was_training = denoiser.training
    denoiser.eval()
    try:
        pipe = spec.build_pipeline(denoiser, vae, text_encoders)
        pipe.set_progress_bar_config(disable=True)
        # A generator of its own, so validation never shifts the training RNG streams.
        generator = torch.Generator(device="cpu").manual_seed(config.seed)
        images = pipe(
            config.validation_prompt,
            num_images_per_prompt=config.num_validation_images,
            num_inference_steps=config.validation_num_inference_steps,
            guidance_scale=config.validation_guidance_scale,
            height=config.resolution,
            width=config.resolution,
            generator=generator,
        ).images
    finally:
        denoiser.train(was_training)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(images):
        path = out_dir / f"step_{step:06d}_{i}.png"
        image.save(path)
        paths.append(path)
    for tracker in trackers:
        if tracker.name == "tensorboard":
            import numpy as np

            stacked = np.stack([np.asarray(img) for img in images])
            tracker.writer.add_images("validation", stacked, step, dataformats="NHWC")
    logger.info("validation images for step %d: %s", step, ", ".join(str(p) for p in paths))
    return paths
