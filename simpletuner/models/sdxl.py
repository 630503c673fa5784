"""Stable Diffusion XL: a ``text_time`` UNet2DConditionModel, AutoencoderKL, and two CLIP text encoders
(CLIPTextModel + CLIPTextModelWithProjection).

Conditioning is ``StableDiffusionXLPipeline.encode_prompt``'s (no clip skip), cached per caption (with
``train_text_encoder`` its token ids are cached and each step embeds them: :mod:`.text_encoder_lora`). The six
micro-conditioning time ids are made per image at training time, as diffusers'
``train_text_to_image_lora_sdxl.py`` makes them, from the size and crop cached with each latent
(:mod:`simpletuner.caching.size_crop`); :meth:`time_ids` gives the pipeline's defaults to a batch without
them. Sources and where SimpleTuner differs: documentation/MODEL_FAMILIES.md, "SDXL".
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Mapping

import torch

from simpletuner.caching.size_crop import SIZE_CROP
from simpletuner.configuration import TrainingConfig
from simpletuner.models.sd import StableDiffusionSpec
from simpletuner.models.text_encoder_lora import token_ids_key


class StableDiffusionXLSpec(StableDiffusionSpec):
    """SDXL with epsilon or v-prediction targets (DDPM noise schedule from the folder's scheduler config)."""

    family = "sdxl"
    default_lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]
    denoiser_name = "unet"
    #: Latent entries hold each image's size and crop (``size_crop``), the first four time ids.
    conditions_on_size_crop: ClassVar[bool] = True
    _tokenizers = frozenset({"CLIPTokenizer", "CLIPTokenizerFast"})
    components = {
        "unet": ("model", "diffusers", frozenset({"UNet2DConditionModel"})),
        "vae": ("model", "diffusers", frozenset({"AutoencoderKL"})),
        "text_encoder": ("model", "transformers", frozenset({"CLIPTextModel"})),
        "text_encoder_2": ("model", "transformers", frozenset({"CLIPTextModelWithProjection"})),
        "tokenizer": ("tokenizer", "transformers", _tokenizers),
        "tokenizer_2": ("tokenizer", "transformers", _tokenizers),
        "scheduler": ("scheduler", "diffusers", re.compile(r"[A-Z][A-Za-z0-9]*Scheduler")),
    }
    text_encoder_classes: ClassVar[dict[str, str]] = {
        "text_encoder": "CLIPTextModel",
        "text_encoder_2": "CLIPTextModelWithProjection",
    }
    #: The first encoder's penultimate hidden state is its whole part (the second's pooled output reads its last).
    unread_last_layer: ClassVar[frozenset[str]] = frozenset({"text_encoder"})

    def __init__(self, config: TrainingConfig):
        super().__init__(config)
        self._vae_scale_factor: int | None = None

    # --- loading -------------------------------------------------------------------------
    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent along a side: 2 ** (number of VAE blocks - 1), from the VAE's config only."""
        if self._vae_scale_factor is None:
            from diffusers import AutoencoderKL

            vae_config = AutoencoderKL.load_config(**self.vae_location().pretrained_args())
            self._vae_scale_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
        return self._vae_scale_factor

    # --- encoding ------------------------------------------------------------------------
    def embed(self, encoders: Mapping[str, Any], ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``encode_prompt``'s conditioning (no clip skip): both encoders' penultimate hidden states, concatenated,
        and the second's pooled projection."""
        hidden, pooled = [], None
        for name in self.text_encoder_classes:
            encoder = encoders[name]
            out = encoder(ids[token_ids_key(name)].to(encoder.device), output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            pooled = out.text_embeds if name == "text_encoder_2" else pooled
        assert pooled is not None  # text_encoder_2 is one of text_encoder_classes
        return {"prompt_embeds": torch.cat(hidden, dim=-1), "pooled_prompt_embeds": pooled}

    # --- training ------------------------------------------------------------------------
    def time_ids(self, latents: torch.Tensor, size_crop: torch.Tensor | None = None) -> torch.Tensor:
        """[B, 6] float32 micro-conditioning of a batch of one bucket: ``size_crop`` ``[B, 4]``
        (``original_h, original_w, crop_top, crop_left`` per sample, see the module docstring), then the
        bucket's pixel size as the target. ``size_crop`` None: the pipeline's default ids at this size
        (original = target, crop ``(0, 0)``). Device-side fills and a copy only: no host sync."""
        height, width = (s * self.vae_scale_factor for s in latents.shape[-2:])
        ids = torch.empty(latents.shape[0], 6, dtype=torch.float32, device=latents.device)
        ids[:, 4], ids[:, 5] = height, width
        if size_crop is None:
            ids[:, 0], ids[:, 1], ids[:, 2:4] = height, width, 0
        else:
            ids[:, :4] = size_crop
        return ids

    def unet_predict(self, unet, noisy, timesteps, conditioning):
        time_ids = self.time_ids(noisy, conditioning.get(SIZE_CROP))
        added = {"text_embeds": conditioning["pooled_prompt_embeds"], "time_ids": time_ids}
        return unet(noisy, timesteps, conditioning["prompt_embeds"], added_cond_kwargs=added, return_dict=False)[0]

    # --- memory estimate -----------------------------------------------------------------
    def batch_shapes(self, batch_size):
        text_1, text_2 = self._required_config("text_encoder"), self._required_config("text_encoder_2")
        max_length = self._max_length("tokenizer", text_1)
        if self._max_length("tokenizer_2", text_2) != max_length:
            raise ValueError(
                f"{self.model_path}: the two tokenizers pad to different lengths; SDXL concatenates their outputs"
            )
        if self.config.train_text_encoder:
            return self.latent_shape(batch_size), self._token_id_shapes(batch_size)
        return self.latent_shape(batch_size), {
            "prompt_embeds": (batch_size, max_length, text_1["hidden_size"] + text_2["hidden_size"]),
            "pooled_prompt_embeds": (batch_size, text_2["projection_dim"]),
        }

    # --- output --------------------------------------------------------------------------
    def lora_pipeline_class(self):
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline

    def build_pipeline(self, denoiser, vae, text_encoders):
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

        unet, text_encoders = self.pipeline_parts(denoiser, text_encoders)
        scheduler = EulerDiscreteScheduler.from_config(
            self.load_noise_scheduler().config, **self.sampling_scheduler_options()
        )
        return StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            text_encoder_2=text_encoders["text_encoder_2"],
            tokenizer=text_encoders["tokenizer"],
            tokenizer_2=text_encoders["tokenizer_2"],
            unet=unet,
            scheduler=scheduler,
            add_watermarker=False,
        )
