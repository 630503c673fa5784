"""What the edit models share (Qwen-Image-Edit, Flux Kontext): each edit pair's latents cached together, the
target's then the source's on the channel axis, each half encoded as the family encodes one image.

:class:`PairedLatents` goes before the family's spec in the bases (``class FluxKontextSpec(PairedLatents,
FluxSpec)``), so its ``super()`` calls reach the family's own ``encode_images`` / ``latent_shape`` (every edit
model's family is a :class:`~simpletuner.models.sd.StableDiffusionSpec`, its base here).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from simpletuner.models.sd import StableDiffusionSpec


class PairedLatents(StableDiffusionSpec):
    """An edit model's latents: ``[B, 2C, h, w]``, target then source (see the module docstring)."""

    conditions_on_image = True
    #: The model's name in messages ("Qwen-Image-Edit").
    edit_model_name: ClassVar[str]
    #: What the model calls the source image in messages ("source", "reference").
    source_noun: ClassVar[str] = "source"

    @torch.no_grad()
    def encode_images(self, vae, pixels):
        """``[B, 6, H, W]`` (target, then source, in [-1, 1]) -> ``[B, 2C, h, w]``: each half encoded as the
        family's pipeline encodes an image, target first.

        Raises:
            ValueError: pixels of one image (the dataset names no sources).
        """
        if pixels.ndim != 4 or pixels.shape[1] != 6:
            raise ValueError(
                f"{self.edit_model_name} encodes image pairs [B, 6, H, W] (target, then {self.source_noun}), got "
                f"{tuple(pixels.shape)}: the dataset has no {self.source_noun} images. Give each dataset its "
                f"{self.source_noun}s (`conditioning_data_dir` or a `conditioning_column`)"
            )
        encode = super().encode_images
        return torch.cat([encode(vae, pixels[:, :3]), encode(vae, pixels[:, 3:])], dim=1)

    def split_pair(self, latents: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached ``[B, 2C, h, w]`` -> (target latents, source latents), ``channels`` being C.

        Raises:
            ValueError: latents of another shape (a cache written for another model).
        """
        if latents.ndim != 4 or latents.shape[1] != 2 * channels:
            raise ValueError(
                f"{self.edit_model_name} latents are [B, {2 * channels}, h, w] (target and {self.source_noun}), got "
                f"{tuple(latents.shape)}: the latent cache was written for another model; clear cache_dir_vae and "
                "cache again"
            )
        return latents[:, :channels], latents[:, channels:]

    def latent_shape(self, batch_size: int) -> tuple[int, ...]:
        """As cached: target and source latents (twice the VAE's channels)."""
        b, c, h, w = super().latent_shape(batch_size)
        return (b, 2 * c, h, w)
