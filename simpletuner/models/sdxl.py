"""Stable Diffusion XL: a ``text_time`` UNet2DConditionModel, AutoencoderKL, and two CLIP text encoders
(CLIPTextModel + CLIPTextModelWithProjection).

Conditioning is ``StableDiffusionXLPipeline.encode_prompt``'s (no clip skip), cached per caption. The six
micro-conditioning time ids are made per image at training time, as diffusers'
``train_text_to_image_lora_sdxl.py`` makes them, from the size and crop cached with each latent
(:mod:`simpletuner.caching.size_crop`); :meth:`time_ids` gives the pipeline's defaults to a batch without
them. Sources and where SimpleTuner differs: documentation/MODEL_FAMILIES.md, "SDXL".
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch

from simpletuner.caching.size_crop import SIZE_CROP
from simpletuner.configuration import TrainingConfig
from simpletuner.models.sd import StableDiffusionSpec


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

    def __init__(self, config: TrainingConfig):
        super().__init__(config)
        self._vae_scale_factor: int | None = None

    # --- loading -------------------------------------------------------------------------
    def load_text_encoders(self, device, dtype):
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        out: dict[str, Any] = {}
        for suffix, encoder_class in (("", CLIPTextModel), ("_2", CLIPTextModelWithProjection)):
            out["tokenizer" + suffix] = CLIPTokenizer.from_pretrained(
                self.model_path, subfolder="tokenizer" + suffix, **self._kwargs()
            )
            encoder = encoder_class.from_pretrained(
                self.model_path, subfolder="text_encoder" + suffix, dtype=dtype, use_safetensors=True, **self._kwargs()
            )
            out["text_encoder" + suffix] = encoder.to(device=device).requires_grad_(False).eval()
        return out

    def text_encoder_identity(self) -> str:
        return self._identity("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent along a side: 2 ** (number of VAE blocks - 1), from the VAE's config only."""
        if self._vae_scale_factor is None:
            from diffusers import AutoencoderKL

            vae_config = AutoencoderKL.load_config(**self.vae_location().pretrained_args())
            self._vae_scale_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
        return self._vae_scale_factor

    # --- encoding ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, text_encoders, captions):
        hidden, pooled = [], None
        for suffix in ("", "_2"):
            tokenizer, encoder = text_encoders["tokenizer" + suffix], text_encoders["text_encoder" + suffix]
            ids = tokenizer(
                captions,
                padding="max_length",
                max_length=tokenizer.model_max_length,
                truncation=True,
                return_tensors="pt",
            ).input_ids.to(encoder.device)
            out = encoder(ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            pooled = out.text_embeds if suffix == "_2" else pooled
        embeds = torch.cat(hidden, dim=-1)
        return [{"prompt_embeds": e, "pooled_prompt_embeds": p} for e, p in zip(embeds, pooled)]

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

    def predict(self, denoiser, noisy, timesteps, conditioning):
        time_ids = self.time_ids(noisy, conditioning.get(SIZE_CROP))
        added = {"text_embeds": conditioning["pooled_prompt_embeds"], "time_ids": time_ids}
        return denoiser(noisy, timesteps, conditioning["prompt_embeds"], added_cond_kwargs=added, return_dict=False)[0]

    # --- memory estimate -----------------------------------------------------------------
    def batch_shapes(self, batch_size):
        text_1, text_2 = self._required_config("text_encoder"), self._required_config("text_encoder_2")
        max_length = self._max_length("tokenizer", text_1)
        if self._max_length("tokenizer_2", text_2) != max_length:
            raise ValueError(
                f"{self.model_path}: the two tokenizers pad to different lengths; SDXL concatenates their outputs"
            )
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

        scheduler = EulerDiscreteScheduler.from_config(
            self.load_noise_scheduler().config, **self.sampling_scheduler_options()
        )
        return StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            text_encoder_2=text_encoders["text_encoder_2"],
            tokenizer=text_encoders["tokenizer"],
            tokenizer_2=text_encoders["tokenizer_2"],
            unet=denoiser,
            scheduler=scheduler,
            add_watermarker=False,
        )
