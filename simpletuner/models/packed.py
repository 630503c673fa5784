"""What Flux and Qwen-Image share: latents packed 2x2 into tokens and the loss taken in that layout,
with the pipeline's resolution-dependent sigma shift when the scheduler asks for it.

Packing (``[B, C, h, w]`` -> ``[B, (h/2)(w/2), 4C]``, as ``FluxPipeline._pack_latents`` and
``QwenImagePipeline._pack_latents`` do) is a reshape, so the mean squared error in packed space is the
one in latent space. The shift: with ``flow_shift`` unset and ``use_dynamic_shifting`` in the scheduler
config, ``mu`` is interpolated from the packed token count between the scheduler's
``base_image_seq_len`` / ``max_image_seq_len`` and ``base_shift`` / ``max_shift``, and a sigma becomes
``e^mu / (e^mu + (1 / sigma - 1))`` (``time_shift_type: linear``: ``mu / (mu + (1 / sigma - 1))``).
"""

from __future__ import annotations

import math

import torch

from simpletuner.data_backend.masks import MASK_KEY
from simpletuner.models import noise as noise_lib
from simpletuner.models.flow import FlowMatchingSpec


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` -> ``[B, (h/2)(w/2), 4C]`` (``FluxPipeline._pack_latents``)."""
    from diffusers import FluxPipeline

    b, c, h, w = latents.shape
    return FluxPipeline._pack_latents(latents, b, c, h, w)


def unpack_latents(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``[B, (h/2)(w/2), 4C]`` -> ``[B, C, h, w]`` for latent sides ``h``, ``w``."""
    from diffusers import FluxPipeline

    # _unpack_latents takes pixel sides and the VAE factor; latent sides with factor 1 are the same thing.
    return FluxPipeline._unpack_latents(packed, h, w, 1)


def dynamic_shift_sigmas(sigmas: torch.Tensor, image_seq_len: int, scheduler_config) -> torch.Tensor:
    """The pipelines' resolution-dependent shift of ``sigmas`` at ``image_seq_len`` packed tokens, with
    the scheduler's ``time_shift_type`` (exponential unless it says linear)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    mu = calculate_shift(
        image_seq_len,
        scheduler_config.get("base_image_seq_len", 256),
        scheduler_config.get("max_image_seq_len", 4096),
        scheduler_config.get("base_shift", 0.5),
        scheduler_config.get("max_shift", 1.15),
    )
    if scheduler_config.get("time_shift_type", "exponential") == "linear":
        return mu / (mu + (1 / sigmas - 1))
    return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))


class PackedFlowSpec(FlowMatchingSpec):
    """A flow-matching family whose pipeline packs 2x2 latents into one token; a subclass writes
    ``predict(denoiser, noisy, sigmas, conditioning, latent_size)`` on packed latents."""

    latent_patch = 2  # the pipeline packs 2x2 latents into one token

    @property
    def dynamic_shift(self) -> bool:
        """Whether sigmas get the resolution-dependent shift (no ``flow_shift`` and a dynamic scheduler)."""
        return self.config.flow_shift is None and bool(
            self.load_noise_scheduler().config.get("use_dynamic_shifting", False)
        )

    def sample_packed_sigmas(self, batch_size: int, generator: torch.Generator, image_seq_len: int) -> torch.Tensor:
        """[B] noise levels in (0, 1), drawn from ``generator``: with the dynamic shift at
        ``image_seq_len`` packed tokens, else with the static one (:meth:`sample_sigmas`)."""
        if not self.dynamic_shift:
            return self.sample_sigmas(batch_size, generator)
        cfg = self.config
        u = noise_lib.sample_u(
            batch_size, generator, cfg.timestep_sampling, cfg.logit_mean, cfg.logit_std, cfg.mode_scale
        )
        return dynamic_shift_sigmas(u, image_seq_len, self.load_noise_scheduler().config)

    def training_loss(self, denoiser, latents, conditioning, generator, is_regularisation_data=False):
        """Per-sample flow-matching loss (:meth:`flow_loss`) on packed latents. Draw order from
        ``generator``: the noise (float32, the 4-D latents' shape), then the sigmas (``sample_sigmas``
        at the packed sequence length)."""
        if latents.ndim != 4:
            raise ValueError(
                f"{self.family} trains on cached 4-D latents [B, C, h, w], got {tuple(latents.shape)}: clear the "
                "latent cache (cache_dir_vae) if it was written by another family"
            )
        _, _, h, w = latents.shape
        if h % 2 or w % 2:
            raise ValueError(
                f"{self.family} packs latents in 2x2 patches: latent sides {h}x{w} must be even "
                "(aspect_bucket_alignment a multiple of 16)"
            )

        def predict(noisy, sigmas):  # the transformer sees sigma itself (the pipeline passes t / 1000)
            return self.predict(denoiser, noisy, sigmas.to(latents.device), conditioning, (h, w))

        return self.flow_loss(
            latents,
            generator,
            predict,
            sample_sigmas=lambda size, gen: self.sample_packed_sigmas(size, gen, (h // 2) * (w // 2)),
            layout=pack_latents,
            denoiser=denoiser,
            is_regularisation_data=is_regularisation_data,
            loss_mask=conditioning.get(MASK_KEY),
        )
