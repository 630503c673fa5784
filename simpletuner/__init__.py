"""simpletuner: diffusion-model fine-tuning for unified-memory superchips and big GPUs."""

__version__ = "0.1.0"
