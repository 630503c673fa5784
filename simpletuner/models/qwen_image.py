"""Qwen-Image (text-to-image): QwenImageTransformer2DModel (MMDiT), the video-style AutoencoderKLQwenImage,
Qwen2.5-VL as text encoder and a FlowMatchEulerDiscreteScheduler with the dynamic shift.

Conditioning is ``QwenImagePipeline.encode_prompt``'s in the chat template (:data:`PROMPT_TEMPLATE`, the
first :data:`TEMPLATE_DROP` tokens dropped), cached at a fixed :data:`QWEN_MAX_LENGTH` with
``prompt_embeds_mask`` and cut back to the batch's longest caption at train time. Latents are cached 4-D
(``[C, h, w]`` per sample) and packed 2x2 for the loss. Step by step, with the pipeline's lines:
documentation/MODEL_FAMILIES.md, "Qwen-Image".
"""

from __future__ import annotations

import functools
import re

import torch

from simpletuner.models.packed import PackedFlowSpec
from simpletuner.models.spec import save_transformer_lora

#: The chat template QwenImagePipeline wraps a prompt in.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
#: Tokens of the template's start (its system prompt) the pipeline drops from the hidden states.
TEMPLATE_DROP = 34
#: The pipeline's tokenizer limit (``tokenizer_max_length``), before the dropped template tokens.
TOKENIZER_MAX_LENGTH = 1024
#: Caption tokens kept and cached: QwenImagePipeline.__call__'s default ``max_sequence_length``.
QWEN_MAX_LENGTH = 512

#: Qwen-Image's scheduler config (the released folder's): the tiny model and the config-only folder use it.
QWEN_IMAGE_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)

TEXT_ENCODER_CLASS = "Qwen2_5_VLForConditionalGeneration"
#: ``model_type`` of the text encoder's ``config.json`` that class reads.
TEXT_ENCODER_MODEL_TYPE = "qwen2_5_vl"


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


@functools.cache
def _validation_pipeline_class(base=None):
    """``base`` (QwenImagePipeline by default; QwenImageEditPipeline for the edit variant) taking the
    validation call's ``guidance_scale`` as its ``true_cfg_scale`` (Qwen-Image has no guidance
    embedding: its guidance is true classifier-free guidance against ``negative_prompt``, and none
    without one)."""
    if base is None:
        from diffusers import QwenImagePipeline as base

    class QwenImageValidationPipeline(base):
        def __call__(self, *args, guidance_scale=None, **kwargs):
            if guidance_scale is not None and "true_cfg_scale" not in kwargs:
                kwargs["true_cfg_scale"] = guidance_scale
            if self.transformer.config.guidance_embeds:
                kwargs["guidance_scale"] = guidance_scale
            return super().__call__(*args, **kwargs)

    return QwenImageValidationPipeline


class QwenImageSpec(PackedFlowSpec):
    """Qwen-Image text-to-image with the rectified-flow target ``noise - latents`` on packed latents."""

    family = "qwen_image"
    # The image stream's attention: SimpleTuner's default (helpers/models/qwen_image/model.py:111) and diffusers'
    # train_dreambooth_lora_qwen_image.py's (l.1284). Qwen-Image-Edit takes the same.
    default_lora_targets = ["to_k", "to_q", "to_v", "to_out.0"]
    denoiser_name = "transformer"
    latent_patch = 2  # the pipeline packs 2x2 latents into one token (the transformer does not patch again)
    components = {
        "transformer": ("model", "diffusers", frozenset({"QwenImageTransformer2DModel"})),
        "vae": ("model", "diffusers", frozenset({"AutoencoderKLQwenImage"})),
        "text_encoder": ("model", "transformers", frozenset({TEXT_ENCODER_CLASS})),
        "tokenizer": ("tokenizer", "transformers", frozenset({"Qwen2Tokenizer", "Qwen2TokenizerFast"})),
        "scheduler": ("scheduler", "diffusers", re.compile(r"[A-Z][A-Za-z0-9]*Scheduler")),
    }

    # --- folder checks -------------------------------------------------------------------
    def check_model_folder(self) -> None:
        """Also the text encoder's own ``config.json``: a folder whose ``model_index.json`` says
        Qwen2.5-VL but whose ``text_encoder`` holds another model is refused before anything loads."""
        super().check_model_folder()
        root, text = self.local_root, self._component_config("text_encoder")
        if root is None or not text:
            return
        found = text.get("architectures") or []
        model_type = text.get("model_type")
        if (found and TEXT_ENCODER_CLASS not in found) or (model_type and model_type != TEXT_ENCODER_MODEL_TYPE):
            named = ", ".join(found) if found else f"model_type {model_type!r}"
            raise ValueError(
                f"{root / 'text_encoder' / 'config.json'} describes {named}; model family 'qwen_image' "
                f"needs the text encoder {TEXT_ENCODER_CLASS} (model_type {TEXT_ENCODER_MODEL_TYPE!r}), the Qwen2.5-VL "
                "model Qwen-Image was trained with. Put that model's text_encoder folder in place, or point "
                "`pretrained_model_name_or_path` at a Qwen-Image pipeline folder"
            )

    def vae_scale_from_folder(self) -> int | None:
        """2 ** len(temperal_downsample), as the pipeline computes it (8 for the released VAE)."""
        vae = self._component_config("vae")
        downs = vae.get("temperal_downsample") if vae else None
        return 2 ** len(downs) if isinstance(downs, list) and downs else None

    # --- loading -------------------------------------------------------------------------
    def load_vae(self, device, dtype):
        from diffusers import AutoencoderKLQwenImage

        vae = AutoencoderKLQwenImage.from_pretrained(
            **self.vae_location().pretrained_args(), torch_dtype=dtype, use_safetensors=True
        )
        return vae.to(device=device).requires_grad_(False).eval()

    def load_text_encoders(self, device, dtype):
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

        tokenizer = Qwen2Tokenizer.from_pretrained(self.model_path, subfolder="tokenizer", **self._kwargs())
        encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            self.model_path, subfolder="text_encoder", dtype=dtype, use_safetensors=True, **self._kwargs()
        )
        return {"tokenizer": tokenizer, "text_encoder": encoder.to(device=device).requires_grad_(False).eval()}

    def load_denoiser(self, dtype=torch.float32):
        from diffusers import QwenImageTransformer2DModel

        return QwenImageTransformer2DModel.from_pretrained(
            self.model_path, subfolder="transformer", torch_dtype=dtype, use_safetensors=True, **self._kwargs()
        )

    # --- encoding ------------------------------------------------------------------------
    @staticmethod
    def _stats(vae, latents):
        shape = (1, vae.config.z_dim) + (1,) * (latents.ndim - 2)
        mean = torch.tensor(vae.config.latents_mean, dtype=latents.dtype, device=latents.device).view(shape)
        std = torch.tensor(vae.config.latents_std, dtype=latents.dtype, device=latents.device).view(shape)
        return mean, std

    @torch.no_grad()
    def encode_images(self, vae, pixels):
        """[B, 3, H, W] images in [-1, 1] -> normalised 4-D latents [B, C, h, w] (the one frame dropped)."""
        if pixels.ndim != 4:
            raise ValueError(f"qwen_image encodes images [B, 3, H, W], got a tensor of shape {tuple(pixels.shape)}")
        pixels = pixels.unsqueeze(2).to(device=vae.device, dtype=vae.dtype)  # one frame
        latents = vae.encode(pixels).latent_dist.mode()
        mean, std = self._stats(vae, latents)
        return ((latents - mean) / std)[:, :, 0]

    @torch.no_grad()
    def encode_prompts(self, text_encoders, captions):
        tokenizer, encoder = text_encoders["tokenizer"], text_encoders["text_encoder"]
        tokens = tokenizer(
            [PROMPT_TEMPLATE.format(c) for c in captions],
            max_length=TOKENIZER_MAX_LENGTH + TEMPLATE_DROP,
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(encoder.device)
        hidden = encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        ).hidden_states[-1]
        out = []
        for states, mask in zip(hidden, tokens.attention_mask.bool()):
            kept = states[mask][TEMPLATE_DROP:][:QWEN_MAX_LENGTH]
            embeds = kept.new_zeros(QWEN_MAX_LENGTH, kept.shape[-1])
            embeds[: kept.shape[0]] = kept
            keep_mask = torch.zeros(QWEN_MAX_LENGTH, dtype=torch.int64, device=kept.device)
            keep_mask[: kept.shape[0]] = 1
            out.append({"prompt_embeds": embeds, "prompt_embeds_mask": keep_mask})
        return out

    # --- training ------------------------------------------------------------------------
    @staticmethod
    def text_inputs(conditioning: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The cached embeddings and mask cut to the batch's longest caption; the mask None when no
        caption in the batch is padded (as the pipeline passes it). Fake tensors (the memory
        estimate) are left at full length."""
        embeds, mask = conditioning["prompt_embeds"], conditioning.get("prompt_embeds_mask")
        if mask is None:
            return embeds, None
        if _is_fake(mask):
            return embeds, mask
        longest = max(int(mask.ne(0).sum(dim=1).max()), 1)
        embeds, mask = embeds[:, :longest], mask[:, :longest]
        return embeds, (None if bool(mask.ne(0).all()) else mask)

    def predict(self, denoiser, noisy, timesteps, conditioning, latent_size):
        """The transformer's packed prediction; ``timesteps`` are sigmas in (0, 1)."""
        embeds, mask = self.text_inputs(conditioning)
        h, w = latent_size
        guidance = None
        if denoiser.config.guidance_embeds:  # no released Qwen-Image has one; guidance 1.0, flux's default
            guidance = torch.ones(noisy.shape[0], device=noisy.device, dtype=torch.float32)
        return denoiser(
            hidden_states=noisy,
            encoder_hidden_states=embeds.to(noisy.dtype),
            encoder_hidden_states_mask=mask,
            timestep=timesteps.to(noisy.dtype),
            img_shapes=[[(1, h // 2, w // 2)]] * noisy.shape[0],
            guidance=guidance,
            return_dict=False,
        )[0]

    # --- memory estimate -----------------------------------------------------------------
    def latent_shape(self, batch_size: int) -> tuple[int, ...]:
        vae = self._required_config("vae")
        side = self.config.resolution // (2 ** len(vae.get("temperal_downsample", [False, True, True])))
        return (batch_size, int(vae.get("z_dim", 16)), side, side)

    def batch_shapes(self, batch_size):
        """At the full cached caption length (:data:`QWEN_MAX_LENGTH`), the most a caption takes."""
        text = self._required_config("text_encoder")
        hidden = int((text.get("text_config") or {}).get("hidden_size") or text["hidden_size"])
        return self.latent_shape(batch_size), {
            "prompt_embeds": (batch_size, QWEN_MAX_LENGTH, hidden),
            "prompt_embeds_mask": (batch_size, QWEN_MAX_LENGTH),
        }

    # --- output --------------------------------------------------------------------------
    def save_lora(self, output_dir, denoiser):
        from diffusers import QwenImagePipeline

        return save_transformer_lora(QwenImagePipeline, output_dir, denoiser)

    def sampling_scheduler(self):
        """The sampling pipelines' scheduler: with ``flow_shift`` set, that static shift (as training
        uses); otherwise the folder's scheduler (dynamic shifting for Qwen-Image)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = self.load_noise_scheduler().config
        if self.config.flow_shift is not None:
            return FlowMatchEulerDiscreteScheduler.from_config(config, shift=self.shift, use_dynamic_shifting=False)
        return FlowMatchEulerDiscreteScheduler.from_config(config)

    def build_pipeline(self, denoiser, vae, text_encoders):
        """Sampling pipeline (a QwenImagePipeline whose ``guidance_scale`` is the classifier-free
        ``true_cfg_scale``, see :func:`_validation_pipeline_class`). With ``flow_shift`` set its
        scheduler uses that static shift (as training does); otherwise the folder's scheduler
        (dynamic shifting for Qwen-Image)."""
        return _validation_pipeline_class()(
            scheduler=self.sampling_scheduler(),
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            tokenizer=text_encoders["tokenizer"],
            transformer=denoiser,
        )
