"""Flux.1 (dev / schnell): FluxTransformer2DModel, a 16-channel AutoencoderKL, CLIP-L (pooled output only) and T5.

Conditioning is ``FluxPipeline.encode_prompt``'s, cached per caption (T5 states padded to ``T5_MAX_LENGTH``,
the CLIP pooled output); latents are cached unpacked ``[16, h, w]`` and packed 2x2 by ``training_loss``, which
takes the loss in packed space. Rectified flow with the pipeline's dynamic shift unless ``flow_shift`` is set;
embedded guidance: :meth:`FluxSpec.training_guidance`. The math next to diffusers' script and SimpleTuner:
documentation/MODEL_FAMILIES.md, "SD3 and Flux".
"""

from __future__ import annotations

import re
from typing import Any

import torch

from simpletuner.configuration import TrainingConfig
from simpletuner.configuration.families import family_keys_changed
from simpletuner.models.packed import PackedFlowSpec
from simpletuner.models.spec import save_transformer_lora

#: T5 tokens per caption: FluxPipeline's default ``max_sequence_length``, so training and
#: validation sampling see the same sequence.
T5_MAX_LENGTH = 512
#: Where :meth:`FluxSpec.training_loss` hands the batch's drawn guidance to :meth:`FluxSpec.predict`.
GUIDANCE_KEY = "guidance"


def latent_image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """Rotary ids ``[(h/2)(w/2), 3]`` of the packed latents of latent sides ``h``, ``w``."""
    from diffusers import FluxPipeline

    return FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, device, dtype)


class FluxSpec(PackedFlowSpec):
    """Flux.1 with the rectified-flow target ``noise - latents`` on packed latents."""

    family = "flux"
    # Our own choice: diffusers' train_dreambooth_lora_flux.py default (the attention of both streams and
    # the feed-forwards of the double blocks, its l.1257-1270) plus `proj_mlp`, the MLP input of the
    # single blocks, which neither that script nor SimpleTuner's default `flux_lora_target: all`
    # (attention only) adapts. documentation/MODEL_FAMILIES.md lists every family's source.
    default_lora_targets = [
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
        "proj_mlp",
    ]
    denoiser_name = "transformer"
    latent_patch = 2  # FluxPipeline packs 2x2 latents into one token (then the transformer's patch_size, 1)

    def latent_patch_from_folder(self) -> int:
        patch = (self._component_config(self.denoiser_name) or {}).get("patch_size", 1)
        return self.latent_patch * (patch if isinstance(patch, int) and patch > 0 else 1)

    def denoiser_latent_channels(self) -> int | None:
        """The transformer's channels are of 2x2-packed latents (64 for Flux.1): a quarter of them per latent."""
        packed = super().denoiser_latent_channels()
        return None if packed is None else packed // (self.latent_patch * self.latent_patch)

    components = {
        "transformer": ("model", "diffusers", frozenset({"FluxTransformer2DModel"})),
        "vae": ("model", "diffusers", frozenset({"AutoencoderKL"})),
        "text_encoder": ("model", "transformers", frozenset({"CLIPTextModel"})),
        "text_encoder_2": ("model", "transformers", frozenset({"T5EncoderModel"})),
        "tokenizer": ("tokenizer", "transformers", frozenset({"CLIPTokenizer", "CLIPTokenizerFast"})),
        "tokenizer_2": ("tokenizer", "transformers", frozenset({"T5Tokenizer", "T5TokenizerFast"})),
        "scheduler": ("scheduler", "diffusers", re.compile(r"[A-Z][A-Za-z0-9]*Scheduler")),
    }

    def __init__(self, config: TrainingConfig):
        super().__init__(config)
        transformer = self._component_config(self.denoiser_name)
        if transformer is not None:  # a hub id: checked when the transformer loads
            self.check_guidance(bool(transformer.get("guidance_embeds", False)))

    def check_guidance(self, has_guidance_embedding: bool) -> None:
        """Refuse ``flux_guidance_*`` settings (other than their defaults) for a transformer without a
        guidance embedding (schnell-like), which takes no guidance: they would do nothing.

        Raises:
            ValueError: naming the keys set and the folder.
        """
        changed = family_keys_changed(self.config, self.family)
        if changed and not has_guidance_embedding:
            raise ValueError(
                f"{', '.join(changed)}: the Flux transformer of {self.model_path} has no guidance embedding "
                "(`guidance_embeds: false`, FLUX.1-schnell-like), so it trains without embedded guidance: remove "
                f"{', '.join(c.split()[0] for c in changed)}"
            )

    def training_guidance(
        self, batch_size: int, generator: torch.Generator | None, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """[B] embedded guidance (float32, on ``device``) for one micro-batch: ``flux_guidance_value`` for every
        sample (``constant``: nothing drawn, made on ``device``), or one uniform draw per sample from the CPU
        ``generator`` in
        [``flux_guidance_min``, ``flux_guidance_max``) (``random-range``; SimpleTuner draws with Python's
        ``random.uniform`` per sample).

        Raises:
            ValueError: ``random-range`` without a generator (the run's seeded draws would be lost).
        """
        cfg = self.config
        if cfg.flux_guidance_mode == "random-range":
            if generator is None:
                raise ValueError(
                    "flux_guidance_mode random-range draws each batch's guidance from the run's generator: "
                    "FluxSpec.predict needs conditioning['guidance'] from training_loss"
                )
            low, high = cfg.flux_guidance_min, cfg.flux_guidance_max
            drawn = low + (high - low) * torch.rand(batch_size, generator=generator)
            return drawn.to(device, non_blocking=True)
        return torch.full((batch_size,), cfg.flux_guidance_value, dtype=torch.float32, device=device)

    # --- loading -------------------------------------------------------------------------
    def load_text_encoders(self, device, dtype):
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

        out: dict[str, Any] = {
            "tokenizer": CLIPTokenizer.from_pretrained(self.model_path, subfolder="tokenizer", **self._kwargs()),
            "tokenizer_2": T5Tokenizer.from_pretrained(self.model_path, subfolder="tokenizer_2", **self._kwargs()),
        }
        for name, cls in (("text_encoder", CLIPTextModel), ("text_encoder_2", T5EncoderModel)):
            encoder = cls.from_pretrained(
                self.model_path, subfolder=name, dtype=dtype, use_safetensors=True, **self._kwargs()
            )
            out[name] = encoder.to(device=device).requires_grad_(False).eval()
        return out

    def load_denoiser(self, dtype=torch.float32):
        from diffusers import FluxTransformer2DModel

        transformer = FluxTransformer2DModel.from_pretrained(
            self.model_path, subfolder="transformer", torch_dtype=dtype, use_safetensors=True, **self._kwargs()
        )
        self.check_guidance(bool(transformer.config.guidance_embeds))
        return transformer

    def text_encoder_identity(self) -> str:
        return self._identity("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")

    # --- encoding ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, text_encoders, captions):
        tokenizer, encoder = text_encoders["tokenizer"], text_encoders["text_encoder"]
        ids = tokenizer(
            captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
        ).input_ids
        pooled = encoder(ids.to(encoder.device), output_hidden_states=False).pooler_output
        tokenizer, encoder = text_encoders["tokenizer_2"], text_encoders["text_encoder_2"]
        ids = tokenizer(
            captions, padding="max_length", max_length=T5_MAX_LENGTH, truncation=True, return_tensors="pt"
        ).input_ids
        embeds = encoder(ids.to(encoder.device), output_hidden_states=False)[0]
        return [{"prompt_embeds": e, "pooled_prompt_embeds": p} for e, p in zip(embeds, pooled)]

    # --- training ------------------------------------------------------------------------
    def training_loss(self, denoiser, latents, conditioning, generator, is_regularisation_data=False):
        """Per-sample loss (:meth:`PackedFlowSpec.training_loss`). With a guidance embedding and
        ``random-range``, the batch's guidance (:meth:`training_guidance`) is drawn first, so draw order from
        ``generator``: the guidance, the noise, the sigmas (``constant`` draws nothing: :meth:`predict` makes it)."""
        if denoiser.config.guidance_embeds and self.config.flux_guidance_mode == "random-range":
            guidance = self.training_guidance(latents.shape[0], generator, latents.device)
            conditioning = {**conditioning, GUIDANCE_KEY: guidance}
        return super().training_loss(denoiser, latents, conditioning, generator, is_regularisation_data)

    def predict(self, denoiser, noisy, timesteps, conditioning, latent_size):
        """The transformer's packed prediction; ``timesteps`` are sigmas in (0, 1)
        (:meth:`transformer_inputs`)."""
        return denoiser(**self.transformer_inputs(denoiser, noisy, timesteps, conditioning, latent_size))[0]

    def transformer_inputs(
        self, transformer, noisy, timesteps, conditioning, latent_size: tuple[int, int]
    ) -> dict[str, Any]:
        """The keyword arguments of one transformer call on the packed ``noisy`` tokens of latent sides
        ``latent_size``, as FluxPipeline makes them. A guidance-distilled transformer takes
        ``conditioning[GUIDANCE_KEY]`` when :meth:`training_loss` put it there, else the constant
        :meth:`training_guidance` (nothing is drawn then)."""
        embeds = conditioning["prompt_embeds"]
        dtype = noisy.dtype
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = conditioning.get(GUIDANCE_KEY)
            if guidance is None:  # constant: made on the device, no copy
                guidance = self.training_guidance(noisy.shape[0], None, noisy.device)
        return dict(
            hidden_states=noisy,
            timestep=timesteps.to(dtype),
            guidance=guidance,
            pooled_projections=conditioning["pooled_prompt_embeds"],
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=noisy.device, dtype=dtype),
            img_ids=latent_image_ids(latent_size[0], latent_size[1], noisy.device, dtype),
            return_dict=False,
        )

    # --- memory estimate -----------------------------------------------------------------
    def batch_shapes(self, batch_size):
        clip, t5 = self._required_config("text_encoder"), self._required_config("text_encoder_2")
        return self.latent_shape(batch_size), {
            "prompt_embeds": (batch_size, T5_MAX_LENGTH, int(t5["d_model"])),
            "pooled_prompt_embeds": (batch_size, int(clip["hidden_size"])),
        }

    # --- output --------------------------------------------------------------------------
    def save_lora(self, output_dir, denoiser):
        from diffusers import FluxPipeline

        return save_transformer_lora(FluxPipeline, output_dir, denoiser)

    def build_pipeline(self, denoiser, vae, text_encoders):
        """Sampling pipeline. With ``flow_shift`` set its scheduler uses that static shift (as
        training does); otherwise the folder's scheduler (dynamic shifting for Flux dev)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

        config = self.load_noise_scheduler().config
        if self.config.flow_shift is not None:
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(
                config, shift=self.shift, use_dynamic_shifting=False
            )
        else:
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        return FluxPipeline(
            transformer=denoiser,
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            tokenizer=text_encoders["tokenizer"],
            text_encoder_2=text_encoders["text_encoder_2"],
            tokenizer_2=text_encoders["tokenizer_2"],
        )
