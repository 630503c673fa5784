"""Wan 2.2 TI2V-5B: one transformer, its own VAE (48 latent channels, /16 spatially), per-token timesteps.

A ``WanPipeline`` folder with ``expand_timesteps: true``. Text-to-video trains as Wan 2.1 (:class:`WanSpec`);
with ``ti2v_first_frame``, latent frame 0 of the cached clip enters clean with timestep 0 and the loss skips
it, which equals the pipeline's image-to-video mode because the causal VAE encodes a first frame alone as
the clip's first latent frame. See documentation/MODEL_FAMILIES.md, "TI2V-5B".
"""

from __future__ import annotations

import torch

from simpletuner.configuration import TrainingConfig
from simpletuner.data_backend.masks import MASK_KEY
from simpletuner.models.wan import WanImageSampler, WanSpec
from simpletuner.models.wan22_i2v import WanFirstFrameSampler


def expands_timesteps(index: dict | None) -> bool:
    """Whether a Wan folder's ``model_index.json`` (``index``) asks for per-token timesteps (TI2V-5B)."""
    return bool(index and index.get("expand_timesteps") is True)


class Wan22TI2VSpec(WanSpec):
    """Wan 2.2 TI2V-5B (see the module docstring)."""

    def __init__(self, config: TrainingConfig):
        super().__init__(config)
        if not expands_timesteps(self.model_index) and self.local_root is not None:
            raise ValueError(
                f"{self.model_path}/model_index.json does not set expand_timesteps: it is not a Wan 2.2 TI2V-5B folder"
            )

    @property
    def first_frame(self) -> bool:
        return bool(self.config.ti2v_first_frame)

    @property
    def takes_validation_image(self) -> bool:
        return self.first_frame  # image-to-video mode renders from a first frame

    def _token_grid(self, latents: torch.Tensor) -> tuple[int, int, int]:
        p = self.latent_patch_from_folder()
        _, _, frames, h, w = latents.shape
        return frames, h // p, w // p

    def training_loss(self, denoiser, latents, conditioning, generator, is_regularisation_data=False):
        """Text-to-video: Wan 2.1's loss. ``ti2v_first_frame`` with more than one latent frame: the
        image-to-video loss over frames 1.. (the module docstring)."""
        if not self.first_frame or latents.shape[2] < 2:
            return super().training_loss(denoiser, latents, conditioning, generator, is_regularisation_data)
        first = latents[:, :, :1]
        frames, th, tw = self._token_grid(latents)
        per_frame = th * tw

        def predict(noisy_rest, sigmas):
            hidden = torch.cat([first.to(noisy_rest.dtype), noisy_rest], dim=2)
            t = self.timesteps_of(sigmas, latents.device)
            # The pipeline's first_frame_mask[:, ::2, ::2] * t, flattened: 0 on frame 0's tokens.
            timestep = torch.cat(
                [
                    torch.zeros(t.shape[0], per_frame, device=t.device, dtype=t.dtype),
                    t[:, None].expand(-1, (frames - 1) * per_frame),
                ],
                dim=1,
            )
            out = self.predict(denoiser, hidden, timestep, conditioning)
            return out[:, :, 1:]

        return self.flow_loss(
            latents,
            generator,
            predict,
            layout=lambda x: x[:, :, 1:],
            denoiser=denoiser,
            is_regularisation_data=is_regularisation_data,
            loss_mask=conditioning.get(MASK_KEY),
        )

    def kept_tokens(self, latents: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor | None:
        """With ``ti2v_first_frame``, TREAD never routes the clean first frame's tokens, as SimpleTuner
        (wan/model.py:779, 926-932)."""
        if self.config.tread_config is None or not self.first_frame or latents.shape[2] < 2:
            return super().kept_tokens(latents, loss_mask)
        _, th, tw = self._token_grid(latents)
        return torch.ones(latents.shape[0], th * tw, dtype=torch.bool, device=latents.device)

    def build_pipeline(self, denoiser, vae, text_encoders):
        """``WanPipeline`` with ``expand_timesteps`` (text-to-video), or with ``ti2v_first_frame``
        ``WanImageToVideoPipeline`` with ``expand_timesteps`` from a mid-grey first frame."""
        sampler = super().build_pipeline(denoiser, vae, text_encoders)
        t2v = sampler.pipe
        if not self.first_frame:
            t2v.register_to_config(expand_timesteps=True)
            return WanImageSampler(t2v, self.max_sequence_length)
        from diffusers import WanImageToVideoPipeline

        pipe = WanImageToVideoPipeline(
            tokenizer=t2v.tokenizer,
            text_encoder=t2v.text_encoder,
            vae=vae,
            scheduler=t2v.scheduler,
            transformer=denoiser,
            expand_timesteps=True,
        )
        return WanFirstFrameSampler(pipe, t2v, self.max_sequence_length)
