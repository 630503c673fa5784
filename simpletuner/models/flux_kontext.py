"""Flux.1 Kontext: Flux (:mod:`simpletuner.models.flux`) edited from a reference image, as ``FluxKontextPipeline``
does it; the ``flux`` variant for a ``FluxKontextPipeline`` folder.

It trains on edit pairs (:mod:`simpletuner.data_backend.pairs`), as Qwen-Image-Edit does. The prompt is Flux's
own (the text encoders never see the reference). The reference enters the latents only: cached with the target
(``cat([target, reference])`` on the channel axis), packed 2x2 and put after the noisy target tokens on the
sequence axis, never noised, with rotary ids whose first entry is 1 (the pipeline's ``image_ids[..., 0] = 1``).
The loss is on the target's tokens. Details and what differs from SimpleTuner: documentation/MODEL_FAMILIES.md,
"Flux Kontext".
"""

from __future__ import annotations

import functools
import math

import torch

from simpletuner.caching.fingerprint import fingerprint
from simpletuner.models.edit_pairs import PairedLatents
from simpletuner.models.flux import FluxSpec, latent_image_ids
from simpletuner.models.packed import pack_latents
from simpletuner.models.spec import save_transformer_lora

#: What the cached latents of a Kontext folder hold (part of their cache key).
KONTEXT_LATENT_LAYOUT = "flux-kontext: target latents + reference latents on the channel axis"
#: The conditioning key training passes the reference latents to :meth:`FluxKontextSpec.predict` under.
REFERENCE_KEY = "kontext_reference_latents"
#: Pixels a reference side is rounded down to a multiple of: the VAE's /8 times the 2x2 packing.
REFERENCE_MULTIPLE = 16


def reference_image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """Rotary ids ``[(h/2)(w/2), 3]`` of the packed reference latents of latent sides ``h``, ``w``: the target's
    grid with the first id 1 (``FluxKontextPipeline.prepare_latents``)."""
    ids = latent_image_ids(h, w, device, dtype).clone()
    ids[:, 0] = 1
    return ids


def reference_size(width: int, height: int, area: int, multiple: int = REFERENCE_MULTIPLE) -> tuple[int, int]:
    """``(width, height)`` of a reference of ``width`` x ``height`` scaled to about ``area`` pixels, its aspect
    ratio kept, each side rounded down to a multiple of ``multiple`` (at least one)."""
    aspect = width / height
    w = max(multiple, int(round(math.sqrt(area * aspect))) // multiple * multiple)
    h = max(multiple, int(round(math.sqrt(area / aspect))) // multiple * multiple)
    return w, h


@functools.cache
def _validation_pipeline_class():
    """FluxKontextPipeline called ``(prompt, image=PIL, height=, width=, ...)`` that renders at ``height`` x
    ``width`` (its ``max_area``) from the reference scaled to that area (:func:`reference_size`), as training
    pairs the reference at the target's size; ``image`` is required."""
    from diffusers import FluxKontextPipeline
    from PIL import Image

    class FluxKontextValidationPipeline(FluxKontextPipeline):
        def __call__(self, prompt=None, image=None, height=None, width=None, **kwargs):
            if image is None:
                raise ValueError(
                    "Flux Kontext renders from a reference image: pass image= (a PIL image; in a training config, "
                    "set `validation_image` to the reference image the validation prompts edit)"
                )
            default = self.default_sample_size * self.vae_scale_factor
            height, width = height or default, width or default
            size = reference_size(image.width, image.height, height * width)
            if image.size != size:
                image = image.resize(size, resample=Image.Resampling.LANCZOS)
            kwargs.setdefault("max_area", height * width)
            return super().__call__(
                prompt=prompt, image=image, height=height, width=width, _auto_resize=False, **kwargs
            )

    return FluxKontextValidationPipeline


class FluxKontextSpec(PairedLatents, FluxSpec):
    """Flux.1 Kontext: edit pairs (target, reference, instruction); see the module docstring. Latents are encoded
    and split as :class:`~simpletuner.models.edit_pairs.PairedLatents` says (each half as the pipeline's
    ``_encode_vae_image``: the distribution's mode, shifted and scaled)."""

    edit_model_name = "Flux Kontext"
    source_noun = "reference"
    prompt_sees_source = False  # Flux's prompt: the text encoders never see the reference

    # --- identities ----------------------------------------------------------------------
    def image_encoder_identity(self) -> str:
        # Cached latents carry the reference too: never shared with a text-to-image run on the same VAE.
        return fingerprint(vae=super().image_encoder_identity(), layout=KONTEXT_LATENT_LAYOUT)

    # --- training ------------------------------------------------------------------------
    def training_loss(self, denoiser, latents, conditioning, generator, is_regularisation_data=False):
        """Flux's packed flow loss (:meth:`FluxSpec.training_loss`) on the target latents; the transformer also
        sees the reference latents, never noised (:meth:`predict`). The sigma shift uses the target's token
        count, as the pipeline's ``mu``."""
        channels = denoiser.config.in_channels // (self.latent_patch * self.latent_patch)
        target, reference = self.split_pair(latents, channels)
        return super().training_loss(
            denoiser, target, {**conditioning, REFERENCE_KEY: reference}, generator, is_regularisation_data
        )

    def predict(self, denoiser, noisy, timesteps, conditioning, latent_size):
        """The transformer's prediction for the packed target tokens ``noisy``, given the packed reference tokens
        after them on the sequence axis with their ids (first id 1), one timestep for both, as the pipeline's
        denoising loop; only the target's tokens are returned."""
        reference = conditioning[REFERENCE_KEY]
        inputs = self.transformer_inputs(denoiser, noisy, timesteps, conditioning, latent_size)
        dtype = noisy.dtype
        inputs["hidden_states"] = torch.cat([noisy, pack_latents(reference).to(dtype)], dim=1)
        ids = reference_image_ids(reference.shape[2], reference.shape[3], noisy.device, dtype)
        inputs["img_ids"] = torch.cat([inputs["img_ids"], ids])
        out = denoiser(**inputs)[0]
        return out[:, : noisy.shape[1]]

    # --- output --------------------------------------------------------------------------
    def save_lora(self, output_dir, denoiser):
        from diffusers import FluxKontextPipeline

        return save_transformer_lora(FluxKontextPipeline, output_dir, denoiser)

    def build_pipeline(self, denoiser, vae, text_encoders):
        """Flux's sampling pipeline and scheduler (:meth:`FluxSpec.build_pipeline`) as a FluxKontextPipeline
        called ``(prompt, image=PIL, ...)`` (see :func:`_validation_pipeline_class`)."""
        components = super().build_pipeline(denoiser, vae, text_encoders).components
        return _validation_pipeline_class()(**components)
