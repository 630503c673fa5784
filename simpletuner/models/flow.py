"""What the flow-matching families (sd3, flux, wan) share: the Euler flow scheduler, the
``flow_matching`` target, the static resolution shift (``flow_shift``, else the scheduler's) and
the loss itself, written once in :meth:`FlowMatchingSpec.flow_loss`.

The loss is rectified flow matching: ``sigma`` is drawn by ``timestep_sampling`` (uniform,
logit_normal, mode) and shifted; ``noisy = (1 - sigma) * latents + sigma * noise``, the target is
``noise - latents``, the per-sample loss ``loss_type`` (mean squared error by default; see
``losses.py``), weighted by ``loss_weighting`` (``sigma_sqrt``, ``cosmap``, ``sigma_squared``). ``noise_offset`` is a
DDPM trick: the config refuses it for these families. A family says how its denoiser is called (``predict``) and, where
needed, how its latents are laid out for it (flux packs 2x2 patches) and how sigmas are drawn
(flux's resolution-dependent shift, Wan 2.2's one-side draw).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable

import torch
from torch import nn

from simpletuner.data_backend.masks import MASK_KEY
from simpletuner.models import losses, tread
from simpletuner.models import noise as noise_lib
from simpletuner.models.sd import StableDiffusionSpec

#: ``predict(noisy, sigmas)``: the denoiser's output for ``noisy`` (laid out as the model takes it)
#: at the [B] noise levels ``sigmas`` (on the CPU, as drawn).
Predict = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class FlowMatchingSpec(StableDiffusionSpec):
    """Base of the flow-matching families; the sd family's loading and encoding otherwise."""

    def load_noise_scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        if self._scheduler is None:
            self._scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
                self.model_path, subfolder="scheduler", **self._kwargs()
            )
        return self._scheduler

    @property
    def prediction_type(self) -> str:
        return "flow_matching"

    @property
    def shift(self) -> float:
        """The resolution shift applied to sampled sigmas: ``flow_shift``, else the scheduler's ``shift``."""
        if self.config.flow_shift is not None:
            return float(self.config.flow_shift)
        return float(self.load_noise_scheduler().config.get("shift", 1.0))

    # --- training ------------------------------------------------------------------------
    def sample_sigmas(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """[B] shifted noise levels in (0, 1), drawn from ``generator``."""
        cfg = self.config
        u = noise_lib.sample_u(
            batch_size, generator, cfg.timestep_sampling, cfg.logit_mean, cfg.logit_std, cfg.mode_scale
        )
        return noise_lib.shift_sigmas(u, self.shift)

    def timesteps_of(self, sigmas: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The timesteps the denoiser sees: ``sigma * num_train_timesteps`` (the [0, 1000] scale the
        pipelines pass), on ``device``."""
        return (sigmas * self.load_noise_scheduler().config.num_train_timesteps).to(device)

    def flow_loss(
        self,
        latents: torch.Tensor,
        generator: torch.Generator,
        predict: Predict,
        sample_sigmas: Callable[[int, torch.Generator], torch.Tensor] | None = None,
        layout: Callable[[torch.Tensor], torch.Tensor] | None = None,
        *,
        denoiser: nn.Module | None = None,
        is_regularisation_data: bool = False,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-sample flow-matching loss, shape [B]. Draw order from ``generator``: the noise
        (float32, the latents' shape), then the sigmas (``sample_sigmas``, by default
        :meth:`sample_sigmas`). ``layout`` rearranges the clean latents and the noise into the
        denoiser's layout before they are mixed (flux's packing); the loss is taken in that layout.
        A regularisation batch of an adapter run (``is_regularisation_data``) trains towards
        ``predict`` with ``denoiser``'s adapters off (the base model), on the same noisy input. ``loss_mask``
        (``[B, 1, h, w]``, the batch's :data:`~simpletuner.data_backend.masks.MASK_KEY`) weights each latent pixel's
        loss (:func:`~simpletuner.models.losses.mask_weights`), laid out as the latents. With ``tread_config`` the
        prediction routes tokens (:mod:`~simpletuner.models.tread`): its draws come from ``generator`` after the
        sigmas, and :meth:`kept_tokens` are never routed."""
        cfg = self.config
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device)
        sigmas = (sample_sigmas or self.sample_sigmas)(latents.shape[0], generator)
        clean = latents.float()
        weight = losses.mask_weights(loss_mask, latents.shape)
        if layout is not None:
            clean, noise = layout(clean), layout(noise)
            weight = layout(weight) if weight is not None else None
        s = sigmas.view(-1, *([1] * (clean.ndim - 1))).to(latents.device)
        noisy = ((1 - s) * clean + s * noise).to(latents.dtype)
        target = noise - clean
        if losses.uses_parent_target(cfg, is_regularisation_data):
            if denoiser is None:
                raise ValueError(f"{type(self).__name__}.flow_loss needs `denoiser` for a regularisation batch")
            target = losses.parent_prediction(denoiser, lambda: predict(noisy, sigmas))
        with self.token_routing(denoiser, generator, self.kept_tokens(latents, loss_mask)):
            pred = predict(noisy, sigmas)
        huber_c = losses.flow_huber_c(sigmas, cfg.huber_schedule, cfg.huber_c) if cfg.loss_type != "l2" else None
        loss = losses.per_sample_loss(pred, target, cfg.loss_type, huber_c, weight)
        if cfg.loss_weighting in ("sigma_sqrt", "cosmap", "sigma_squared"):
            loss = loss * noise_lib.flow_weights(sigmas, cfg.loss_weighting).to(loss.device)
        return loss

    def kept_tokens(self, latents: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, S]`` (bool) the tokens TREAD never routes, over the first ``S`` tokens of the sequence: those a loss
        mask covers (:func:`~simpletuner.models.tread.token_mask`); None: any."""
        return tread.token_mask(loss_mask, self.latent_patch) if self.config.tread_config is not None else None

    def token_routing(
        self, denoiser: nn.Module | None, generator: torch.Generator, kept_tokens: torch.Tensor | None
    ) -> AbstractContextManager[None]:
        """Where ``denoiser``'s TREAD routing draws for one prediction and which tokens it keeps
        (:func:`~simpletuner.models.tread.routing_draws`); nothing without ``tread_config``."""
        if self.config.tread_config is None or denoiser is None:
            return nullcontext()
        return tread.routing_draws(denoiser, generator, kept_tokens)

    def training_loss(self, denoiser, latents, conditioning, generator, is_regularisation_data=False):
        """Per-sample flow-matching loss (:meth:`flow_loss`) with the family's :meth:`predict`."""

        def predict(noisy, sigmas):
            return self.predict(denoiser, noisy, self.timesteps_of(sigmas, latents.device), conditioning)

        return self.flow_loss(
            latents,
            generator,
            predict,
            denoiser=denoiser,
            is_regularisation_data=is_regularisation_data,
            loss_mask=conditioning.get(MASK_KEY),
        )
