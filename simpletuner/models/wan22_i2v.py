"""Wan 2.2 image-to-video A14B: two experts, the first frame of each clip as the condition.

Training builds the condition as :meth:`WanImageToVideoPipeline.prepare_latents` does (the VAE encoding of
the frame followed by black frames, a first-frame mask, 36 input channels). The condition latents are
cached with the clip's, ``cat([clip, condition])`` on the channel axis, and split again by
:meth:`Wan22I2VSpec.training_loss`; everything else is :class:`simpletuner.models.wan22.Wan22Spec`'s.
See documentation/MODEL_FAMILIES.md, "I2V A14B".
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from simpletuner.caching.fingerprint import fingerprint
from simpletuner.configuration import TrainingConfig
from simpletuner.models.wan import WAN_MAX_LENGTH
from simpletuner.models.wan22 import Wan22Spec, WanExperts

#: What the cached latents of an I2V folder hold (part of their cache key).
I2V_LATENT_LAYOUT = "wan-i2v: clip latents + first-frame condition latents on the channel axis"
#: The mid-grey first frame validation renders from (see :class:`WanFirstFrameSampler`).
VALIDATION_FIRST_FRAME_VALUE = 0.5


def first_frame_mask(shape: tuple[int, ...], temporal: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The pipeline's mask for latents of ``shape`` ``[B, C, F', h, w]``: ``[B, temporal, F', h, w]``,
    ones on latent frame 0 (the ``temporal`` pixel frames it stands for are the given image, the
    first one repeated), zeros on the others."""
    b, _, frames, h, w = shape
    mask = torch.zeros(b, temporal, frames, h, w, device=device, dtype=dtype)
    mask[:, :, 0] = 1
    return mask


class Wan22I2VSpec(Wan22Spec):
    """Wan 2.2 I2V A14B: both experts, first-frame conditioning (see the module docstring)."""

    def __init__(self, config: TrainingConfig):
        super().__init__(config)
        vae = self._component_config("vae") or {}
        self.temporal = int(vae.get("scale_factor_temporal") or 4)
        self.z_dim = int(vae.get("z_dim", 16))

    takes_validation_image = True  # the first frame

    def image_encoder_identity(self) -> str:
        # Cached latents carry the condition too: never shared with a T2V run on the same VAE.
        return fingerprint(vae=super().image_encoder_identity(), layout=I2V_LATENT_LAYOUT)

    # --- encoding ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, vae, pixels):
        """``cat([clip latents, condition latents])``: the condition is the encoding of the first
        frame followed by zero frames, as the pipeline encodes its image."""
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        clip = super().encode_images(vae, pixels)
        first = pixels[:, :, :1]
        condition_pixels = torch.cat(
            [first, first.new_zeros(first.shape[:2] + (pixels.shape[2] - 1,) + first.shape[3:])], dim=2
        )
        condition = super().encode_images(vae, condition_pixels)
        return torch.cat([clip, condition], dim=1)

    def split_latents(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached ``[B, 2z, F', h, w]`` -> (clip latents, condition latents)."""
        if latents.shape[1] != 2 * self.z_dim:
            raise ValueError(
                f"Wan 2.2 I2V latents have {latents.shape[1]} channels, expected {2 * self.z_dim} (clip and "
                "first-frame condition): the latent cache was written for another model; clear cache_dir_vae and "
                "cache again"
            )
        return latents[:, : self.z_dim], latents[:, self.z_dim :]

    def condition_input(self, condition: torch.Tensor) -> torch.Tensor:
        """The channels the pipeline appends to the noisy latents: ``cat([mask, condition latents])``."""
        mask = first_frame_mask(condition.shape, self.temporal, device=condition.device, dtype=condition.dtype)
        return torch.cat([mask, condition], dim=1)

    # --- training ------------------------------------------------------------------------
    def training_loss(self, denoiser, latents, conditioning, generator, is_regularisation_data=False):
        """Wan 2.2's routed flow loss on the clip latents; the denoiser sees them with the
        first-frame condition appended (:meth:`predict`)."""
        clip, condition = self.split_latents(latents)
        conditioning = {**conditioning, "i2v_condition": self.condition_input(condition)}
        return super().training_loss(
            denoiser, clip, conditioning, generator, is_regularisation_data=is_regularisation_data
        )

    def predict(self, denoiser, noisy, timesteps, conditioning, route=None):
        hidden = torch.cat([noisy, conditioning["i2v_condition"].to(noisy.dtype)], dim=1)
        return super().predict(denoiser, hidden, timesteps, conditioning, route=route)

    # --- memory estimate -----------------------------------------------------------------
    def latent_shape(self, batch_size: int, frames: int = 1) -> tuple[int, ...]:
        """As cached: clip and condition latents (twice the VAE's channels)."""
        b, c, *rest = super().latent_shape(batch_size, frames)
        return (b, 2 * c, *rest)

    # --- output --------------------------------------------------------------------------
    def build_pipeline(
        self, denoiser: nn.Module, vae: nn.Module, text_encoders: dict[str, Any]
    ) -> WanFirstFrameSampler:
        """A ``WanImageToVideoPipeline`` with both experts, rendering from a mid-grey first frame."""
        from diffusers import WanImageToVideoPipeline

        assert isinstance(denoiser, WanExperts)

        t2v = super().build_pipeline(denoiser, vae, text_encoders).pipe
        pipe = WanImageToVideoPipeline(
            tokenizer=t2v.tokenizer,
            text_encoder=t2v.text_encoder,
            vae=vae,
            scheduler=t2v.scheduler,
            transformer=denoiser.expert("high"),
            transformer_2=denoiser.expert("low"),
            boundary_ratio=self.boundary_ratio,
        )
        return WanFirstFrameSampler(pipe, t2v, self.max_sequence_length)


class WanFirstFrameSampler:
    """An image-to-video Wan pipeline called as the validation loop calls an image pipeline: the
    first frame is ``image`` when given, else a flat mid-grey frame of the requested size (the
    validation prompts carry no image); ``.images`` are the first frames, ``.frames`` the videos.

    Prompts are encoded by ``text_pipe`` (the ``WanPipeline`` on the same tokenizer and text
    encoder, identical T5 embeddings): diffusers' image-to-video pipeline cleans prompts with
    ``ftfy`` unconditionally, which is an optional dependency."""

    def __init__(self, pipe, text_pipe, max_sequence_length: int = WAN_MAX_LENGTH):
        self.pipe = pipe
        self.text_pipe = text_pipe
        self.max_sequence_length = max_sequence_length

    def set_progress_bar_config(self, **kwargs):
        self.pipe.set_progress_bar_config(**kwargs)

    def __call__(self, prompt, num_images_per_prompt: int = 1, num_frames: int = 1, image=None, **kwargs):
        from PIL import Image

        if image is None:
            height, width = kwargs.get("height", 480), kwargs.get("width", 832)
            grey = round(255 * VALIDATION_FIRST_FRAME_VALUE)
            image = Image.new("RGB", (width, height), (grey, grey, grey))
        guidance = kwargs.get("guidance_scale", 5.0)
        positive, negative = self.text_pipe.encode_prompt(
            prompt,
            kwargs.pop("negative_prompt", None),
            do_classifier_free_guidance=guidance > 1,
            num_videos_per_prompt=num_images_per_prompt,
            max_sequence_length=kwargs.pop("max_sequence_length", self.max_sequence_length),
            device=self.text_pipe.text_encoder.device,
        )
        videos = self.pipe(
            image=image,
            prompt_embeds=positive,
            negative_prompt_embeds=negative,
            num_frames=num_frames,
            output_type="pil",
            **kwargs,
        ).frames
        return SimpleNamespace(images=[video[0] for video in videos], frames=videos)
