"""Stable Diffusion 3: SD3Transformer2DModel (MMDiT), a 16-channel AutoencoderKL, CLIP-L and CLIP-G with
projection, and a T5 encoder where the folder has one.

Conditioning is ``StableDiffusion3Pipeline.encode_prompt``'s (no clip skip), cached per caption; training is
rectified flow matching with the timestep on the pipeline's [0, 1000] scale. Shapes, the T5-less folder and
the loss next to diffusers' script: documentation/MODEL_FAMILIES.md, "SD3 and Flux".
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F

from simpletuner.caching.fingerprint import fingerprint
from simpletuner.models.flow import FlowMatchingSpec
from simpletuner.models.spec import save_transformer_lora

#: T5 tokens per caption: StableDiffusion3Pipeline's default ``max_sequence_length``, so training
#: and validation sampling see the same sequence.
T5_MAX_LENGTH = 256
#: Components a folder may name null (``[null, null]`` in ``model_index.json``): SD3 without T5.
_OPTIONAL = frozenset({"text_encoder_3", "tokenizer_3"})


class StableDiffusion3Spec(FlowMatchingSpec):
    """SD3 / SD3.5 with the rectified-flow target ``noise - latents``."""

    family = "sd3"
    # diffusers' train_dreambooth_lora_sd3.py default (attention of both streams, its l.1251-1260), written as
    # suffixes: the same layers on SD3 Medium, but on SD3.5 Medium's dual-attention blocks they also match `attn2`
    # (the script's `attn.to_q` ... do not). SimpleTuner's default is `to_q/k/v/out.0` only (no context stream).
    default_lora_targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
    denoiser_name = "transformer"
    _clip_tokenizers = frozenset({"CLIPTokenizer", "CLIPTokenizerFast"})
    components = {
        "transformer": ("model", "diffusers", frozenset({"SD3Transformer2DModel"})),
        "vae": ("model", "diffusers", frozenset({"AutoencoderKL"})),
        "text_encoder": ("model", "transformers", frozenset({"CLIPTextModelWithProjection"})),
        "text_encoder_2": ("model", "transformers", frozenset({"CLIPTextModelWithProjection"})),
        "text_encoder_3": ("model", "transformers", frozenset({"T5EncoderModel"})),
        "tokenizer": ("tokenizer", "transformers", _clip_tokenizers),
        "tokenizer_2": ("tokenizer", "transformers", _clip_tokenizers),
        "tokenizer_3": ("tokenizer", "transformers", frozenset({"T5Tokenizer", "T5TokenizerFast"})),
        "scheduler": ("scheduler", "diffusers", re.compile(r"[A-Z][A-Za-z0-9]*Scheduler")),
    }

    latent_patch = 2  # SD3Transformer2DModel's patch_size in every release

    def latent_patch_from_folder(self) -> int:
        patch = (self._component_config(self.denoiser_name) or {}).get("patch_size", self.latent_patch)
        return patch if isinstance(patch, int) and patch > 0 else self.latent_patch

    def positions_per_side(self):
        most = (self._component_config(self.denoiser_name) or {}).get("pos_embed_max_size")
        return (most, "pos_embed_max_size") if isinstance(most, int) and most > 0 else None

    def _check_index_entry(self, index_file, name, entry, library, allowed):
        if name in _OPTIONAL and entry == [None, None]:
            return  # SD3 without T5
        super()._check_index_entry(index_file, name, entry, library, allowed)

    @property
    def has_t5(self) -> bool:
        """Whether the folder has a T5 encoder (a hub id is assumed to have one)."""
        root = self.local_root
        if root is None:
            return True
        if self.model_index is not None and self.model_index.get("text_encoder_3") in (None, [None, None]):
            return False
        return (root / "text_encoder_3").is_dir()

    # --- loading -------------------------------------------------------------------------
    def load_text_encoders(self, device, dtype):
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5Tokenizer

        out: dict[str, Any] = {}
        for suffix in ("", "_2"):
            out["tokenizer" + suffix] = CLIPTokenizer.from_pretrained(
                self.model_path, subfolder="tokenizer" + suffix, **self._kwargs()
            )
            encoder = CLIPTextModelWithProjection.from_pretrained(
                self.model_path, subfolder="text_encoder" + suffix, dtype=dtype, use_safetensors=True, **self._kwargs()
            )
            out["text_encoder" + suffix] = encoder.to(device=device).requires_grad_(False).eval()
        if self.has_t5:
            out["tokenizer_3"] = T5Tokenizer.from_pretrained(self.model_path, subfolder="tokenizer_3", **self._kwargs())
            encoder = T5EncoderModel.from_pretrained(
                self.model_path, subfolder="text_encoder_3", dtype=dtype, use_safetensors=True, **self._kwargs()
            )
            out["text_encoder_3"] = encoder.to(device=device).requires_grad_(False).eval()
        return out

    def load_denoiser(self, dtype=torch.float32):
        from diffusers import SD3Transformer2DModel

        return SD3Transformer2DModel.from_pretrained(
            self.model_path, subfolder="transformer", torch_dtype=dtype, use_safetensors=True, **self._kwargs()
        )

    @property
    def t5_length(self) -> int:
        """T5 tokens per caption: `t5_max_length`, else the pipeline's default."""
        return self.config.t5_max_length or T5_MAX_LENGTH

    def text_encoder_identity(self) -> str:
        parts = ["tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"]
        if self.has_t5:
            parts += ["tokenizer_3", "text_encoder_3"]
        identity = self._identity(*parts)
        # The default length keeps the identity it always had, so caches made before the key existed stay valid.
        return identity if self.t5_length == T5_MAX_LENGTH else fingerprint(text=identity, t5_tokens=self.t5_length)

    def _joint_attention_dim(self) -> int:
        from diffusers import SD3Transformer2DModel

        return int(
            SD3Transformer2DModel.load_config(self.model_path, subfolder="transformer", **self._kwargs())[
                "joint_attention_dim"
            ]
        )

    # --- encoding ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, text_encoders, captions):
        clip_length = text_encoders["tokenizer"].model_max_length  # the pipeline pads both CLIPs to this
        hidden, pooled = [], []
        for suffix in ("", "_2"):
            tokenizer, encoder = text_encoders["tokenizer" + suffix], text_encoders["text_encoder" + suffix]
            ids = tokenizer(
                captions, padding="max_length", max_length=clip_length, truncation=True, return_tensors="pt"
            ).input_ids
            out = encoder(ids.to(encoder.device), output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        clip_embeds = torch.cat(hidden, dim=-1)
        if "text_encoder_3" in text_encoders:
            tokenizer, encoder = text_encoders["tokenizer_3"], text_encoders["text_encoder_3"]
            ids = tokenizer(
                captions,
                padding="max_length",
                max_length=self.t5_length,
                truncation=True,
                add_special_tokens=True,
                return_tensors="pt",
            ).input_ids
            t5_embeds = encoder(ids.to(encoder.device))[0].to(clip_embeds.dtype)
        else:
            t5_embeds = clip_embeds.new_zeros((len(captions), self.t5_length, self._joint_attention_dim()))
        clip_embeds = F.pad(clip_embeds, (0, t5_embeds.shape[-1] - clip_embeds.shape[-1]))
        embeds = torch.cat([clip_embeds, t5_embeds], dim=-2)
        pooled_embeds = torch.cat(pooled, dim=-1)
        return [{"prompt_embeds": e, "pooled_prompt_embeds": p} for e, p in zip(embeds, pooled_embeds)]

    # --- training (FlowMatchingSpec.flow_loss) ---------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning):
        return denoiser(
            hidden_states=noisy,
            timestep=timesteps,
            encoder_hidden_states=conditioning["prompt_embeds"],
            pooled_projections=conditioning["pooled_prompt_embeds"],
            return_dict=False,
        )[0]

    # --- memory estimate -----------------------------------------------------------------
    def batch_shapes(self, batch_size):
        text_1, text_2 = self._required_config("text_encoder"), self._required_config("text_encoder_2")
        clip_length = self._max_length("tokenizer", text_1)
        if self.has_t5:
            width = int(self._required_config("text_encoder_3")["d_model"])
        else:
            width = int(self._required_config("transformer")["joint_attention_dim"])
        return self.latent_shape(batch_size), {
            "prompt_embeds": (batch_size, clip_length + self.t5_length, width),
            "pooled_prompt_embeds": (batch_size, text_1["projection_dim"] + text_2["projection_dim"]),
        }

    # --- output --------------------------------------------------------------------------
    def save_lora(self, output_dir, denoiser):
        from diffusers import StableDiffusion3Pipeline

        return save_transformer_lora(StableDiffusion3Pipeline, output_dir, denoiser)

    def build_pipeline(self, denoiser, vae, text_encoders):
        """Sampling pipeline; its Euler flow scheduler uses the training shift (``flow_shift`` when set)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.load_noise_scheduler().config, shift=self.shift)
        return StableDiffusion3Pipeline(
            transformer=denoiser,
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            tokenizer=text_encoders["tokenizer"],
            text_encoder_2=text_encoders["text_encoder_2"],
            tokenizer_2=text_encoders["tokenizer_2"],
            text_encoder_3=text_encoders.get("text_encoder_3"),
            tokenizer_3=text_encoders.get("tokenizer_3"),
        )
