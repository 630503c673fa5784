"""Stable Diffusion 1.x / 2.x: UNet2DConditionModel + AutoencoderKL + one CLIP text encoder."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from simpletuner.caching.fingerprint import fingerprint, folder_identity
from simpletuner.configuration import TrainingConfig
from simpletuner.data_backend.masks import MASK_KEY
from simpletuner.file_modes import ordinary_permissions
from simpletuner.models import losses
from simpletuner.models import noise as noise_lib
from simpletuner.models.spec import ModelSpec

logger = logging.getLogger(__name__)


class StableDiffusionSpec(ModelSpec):
    """SD 1.x/2.x with epsilon or v-prediction targets (DDPM noise schedule)."""

    family = "sd"
    default_lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]
    denoiser_name = "unet"
    components = {
        "unet": ("model", "diffusers", frozenset({"UNet2DConditionModel"})),
        "vae": ("model", "diffusers", frozenset({"AutoencoderKL"})),
        "text_encoder": ("model", "transformers", frozenset({"CLIPTextModel"})),
        "tokenizer": ("tokenizer", "transformers", frozenset({"CLIPTokenizer", "CLIPTokenizerFast"})),
        "scheduler": ("scheduler", "diffusers", re.compile(r"[A-Z][A-Za-z0-9]*Scheduler")),
    }

    def __init__(self, config: TrainingConfig):
        super().__init__(config)
        self._scheduler = None

    # --- loading -------------------------------------------------------------------------
    def _kwargs(self) -> dict[str, Any]:
        return {"revision": self.config.revision} if self.config.revision else {}

    def load_noise_scheduler(self):
        from diffusers import DDPMScheduler

        if self._scheduler is None:
            options = {"rescale_betas_zero_snr": True} if self.config.rescale_betas_zero_snr else {}
            self._scheduler = DDPMScheduler.from_pretrained(
                self.model_path, subfolder="scheduler", **options, **self._kwargs()
            )
        return self._scheduler

    def sampling_scheduler_options(self) -> dict[str, Any]:
        """Options of the validation scheduler beyond the training one's config: zero terminal SNR samples with
        trailing timestep spacing (diffusers' advice for such models), so its first step starts at pure noise."""
        options: dict[str, Any] = {"prediction_type": self.prediction_type}
        if self.config.rescale_betas_zero_snr:
            options["timestep_spacing"] = "trailing"
        return options

    @property
    def prediction_type(self) -> str:
        return self.config.prediction_type or self.load_noise_scheduler().config.prediction_type

    def load_vae(self, device, dtype):
        from diffusers import AutoencoderKL

        # use_safetensors=True on every weights load: never unpickle a file we did not write.
        vae = AutoencoderKL.from_pretrained(
            **self.vae_location().pretrained_args(), torch_dtype=dtype, use_safetensors=True
        )
        return vae.to(device=device).requires_grad_(False).eval()

    def load_text_encoders(self, device, dtype):
        from transformers import CLIPTextModel, CLIPTokenizer

        tokenizer = CLIPTokenizer.from_pretrained(self.model_path, subfolder="tokenizer", **self._kwargs())
        encoder = CLIPTextModel.from_pretrained(
            self.model_path, subfolder="text_encoder", dtype=dtype, use_safetensors=True, **self._kwargs()
        )
        encoder = encoder.to(device=device).requires_grad_(False).eval()
        return {"tokenizer": tokenizer, "text_encoder": encoder}

    def load_denoiser(self, dtype=torch.float32):
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel.from_pretrained(
            self.model_path, subfolder="unet", torch_dtype=dtype, use_safetensors=True, **self._kwargs()
        )

    # --- identities ----------------------------------------------------------------------
    def _identity(self, *subfolders: str) -> str:
        root = Path(self.model_path).expanduser()
        if root.is_dir():
            return fingerprint(parts={s: folder_identity(root / s) for s in subfolders})
        return fingerprint(hub_id=self.model_path, revision=self.config.revision or "main", parts=list(subfolders))

    def image_encoder_identity(self) -> str:
        """The VAE's files wherever it loads from (:meth:`vae_location`); for the model's own VAE the identity it
        always had, so caches made before ``pretrained_vae_model_name_or_path`` existed stay valid."""
        location = self.vae_location()
        if not location.is_separate:
            return self._identity("vae")
        folder = location.local_folder
        if folder is not None:
            return fingerprint(parts={"vae": folder_identity(folder)})
        return fingerprint(hub_id=location.path, revision="main", parts=[location.subfolder or "."])

    def text_encoder_identity(self) -> str:
        return self._identity("tokenizer", "text_encoder")

    # --- encoding ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, vae, pixels):
        pixels = pixels.to(device=vae.device, dtype=vae.dtype)
        # The distribution mean, not a sample: a cached latent must not freeze one noise draw.
        latents = vae.encode(pixels).latent_dist.mode()
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return (latents - shift) * vae.config.scaling_factor

    @torch.no_grad()
    def encode_prompts(self, text_encoders, captions):
        tokenizer, encoder = text_encoders["tokenizer"], text_encoders["text_encoder"]
        ids = tokenizer(
            captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
        ).input_ids.to(encoder.device)
        embeds = encoder(ids)[0]
        return [{"prompt_embeds": e} for e in embeds]

    # --- training ------------------------------------------------------------------------
    def training_loss(self, denoiser, latents, conditioning, generator, is_regularisation_data=False):
        """Per-sample DDPM loss, shape [B]. Draw order from ``generator``: the noise, the timesteps,
        then (``noise_offset`` > 0) the offset noise's gate and offsets. A regularisation batch of an
        adapter run trains towards the base model's prediction on the same noisy input
        (:func:`~simpletuner.models.losses.uses_parent_target`)."""
        scheduler = self.load_noise_scheduler()
        bsz = latents.shape[0]
        # Noise and timesteps come from our own CPU generator so a resumed run draws the same ones.
        cfg = self.config
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device, latents.dtype)
        if cfg.timestep_sampling == "uniform":  # the original draw, kept so existing runs resume identically
            timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (bsz,), generator=generator)
        else:
            u = noise_lib.sample_u(bsz, generator, cfg.timestep_sampling, cfg.logit_mean, cfg.logit_std, cfg.mode_scale)
            timesteps = noise_lib.ddpm_timesteps(u, scheduler.config.num_train_timesteps)
        noise = noise_lib.offset_noise(noise, generator, cfg.noise_offset, cfg.noise_offset_probability)
        weights = (
            noise_lib.min_snr_weights(timesteps, scheduler, cfg.snr_gamma, self.prediction_type)
            if cfg.loss_weighting == "min_snr"
            else None
        )
        huber_c = None
        if cfg.loss_type != "l2":
            huber_c = losses.ddpm_huber_c(timesteps, scheduler, cfg.huber_schedule, cfg.huber_c)
        timesteps = timesteps.to(latents.device)
        noisy = scheduler.add_noise(latents, noise, timesteps)
        if self.prediction_type == "epsilon":
            target = noise
        elif self.prediction_type == "v_prediction":
            target = scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(
                f"prediction_type {self.prediction_type!r} is not supported by family {self.family!r} "
                "(epsilon, v_prediction)"
            )
        if losses.uses_parent_target(cfg, is_regularisation_data):
            target = losses.parent_prediction(denoiser, lambda: self.predict(denoiser, noisy, timesteps, conditioning))
        pred = self.predict(denoiser, noisy, timesteps, conditioning)
        mask = losses.mask_weights(conditioning.get(MASK_KEY), latents.shape)  # masked loss: each latent pixel's weight
        loss = losses.per_sample_loss(pred, target, cfg.loss_type, huber_c, mask)
        return loss if weights is None else loss * weights.to(loss.device)

    def predict(self, denoiser, noisy, timesteps, conditioning):
        """The denoiser's output for a noisy batch: the one call that differs between UNet families."""
        return denoiser(noisy, timesteps, conditioning["prompt_embeds"], return_dict=False)[0]

    # --- memory estimate -----------------------------------------------------------------
    def _required_config(self, subfolder: str) -> dict[str, Any]:
        found = self.read_component_config(subfolder)
        if found is None:
            raise ValueError(
                f"{self.component_location(subfolder).describe()}/config.json does not exist: the estimator needs it "
                "(configs are enough)"
            )
        return found

    def _max_length(self, tokenizer: str, text_config: dict[str, Any]) -> int:
        """The tokenizer's padded length (the text encoder's positions when there is no tokenizer)."""
        tokenizer_config = self.read_component_config(tokenizer, "tokenizer_config.json") or {}
        return int(tokenizer_config.get("model_max_length", text_config["max_position_embeddings"]))

    def latent_shape(self, batch_size: int) -> tuple[int, ...]:
        """Latents of a square ``resolution`` image: the VAE's channels, sides divided by its down factor."""
        vae = self._required_config("vae")
        side = self.config.resolution // 2 ** (len(vae["block_out_channels"]) - 1)
        return (batch_size, vae["latent_channels"], side, side)

    def batch_shapes(self, batch_size):
        text = self._required_config("text_encoder")
        embeds = (batch_size, self._max_length("tokenizer", text), text["hidden_size"])
        return self.latent_shape(batch_size), {"prompt_embeds": embeds}

    # --- output --------------------------------------------------------------------------
    def lora_pipeline_class(self):
        """The diffusers pipeline whose ``save_lora_weights`` / ``load_lora_weights`` own the file format."""
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline

    def save_lora(self, output_dir, denoiser):
        from peft.utils import get_peft_model_state_dict

        # PEFT's keys as they are (lora_A / lora_B), which the pipeline's loader reads for any target module:
        # convert_state_dict_to_diffusers renames only the attention projections to the old `lora.down` form, and a
        # file mixing both forms (lora_target_modules with proj_in, say) loads only in part.
        layers = get_peft_model_state_dict(denoiser)
        self.lora_pipeline_class().save_lora_weights(
            save_directory=str(output_dir),
            unet_lora_layers=layers,
            unet_lora_adapter_metadata=denoiser.peft_config["default"].to_dict(),
            safe_serialization=True,
        )
        path = Path(output_dir) / "pytorch_lora_weights.safetensors"
        ordinary_permissions(path)  # safetensors (under diffusers) writes 0600
        return path

    def save_full(self, output_dir, denoiser):
        target = Path(output_dir) / self.denoiser_name
        denoiser.save_pretrained(target, safe_serialization=True)
        ordinary_permissions(target)
        return target

    def build_pipeline(self, denoiser, vae, text_encoders):
        from diffusers import DDIMScheduler, StableDiffusionPipeline

        scheduler = DDIMScheduler.from_config(self.load_noise_scheduler().config, **self.sampling_scheduler_options())
        return StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            tokenizer=text_encoders["tokenizer"],
            unet=denoiser,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
