"""Stable Diffusion 1.x / 2.x: UNet2DConditionModel + AutoencoderKL + one CLIP text encoder."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, ClassVar, Mapping

import torch

from simpletuner.caching.fingerprint import fingerprint, folder_identity
from simpletuner.configuration import TrainingConfig
from simpletuner.data_backend.masks import MASK_KEY
from simpletuner.file_modes import ordinary_permissions
from simpletuner.models import losses
from simpletuner.models import noise as noise_lib
from simpletuner.models import text_encoder_lora as te_lora
from simpletuner.models.spec import ModelSpec, resolve_component_class
from simpletuner.models.text_encoder_lora import UNetWithTextEncoders, token_ids_key

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
    #: The CLIP text encoders, pipeline component -> transformers class name, in the pipeline's order; each has
    #: its tokenizer in ``tokenizer<suffix>``. ``train_text_encoder`` trains a LoRA on every one.
    text_encoder_classes: ClassVar[dict[str, str]] = {"text_encoder": "CLIPTextModel"}
    #: The text encoders whose last layer the conditioning never reads (:meth:`embed`): their LoRA leaves it out.
    unread_last_layer: ClassVar[frozenset[str]] = frozenset()

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
        """The tokenizers and the frozen text encoders (on ``device``, in ``dtype``) the cache fill and validation
        use; with ``train_text_encoder`` the tokenizers only: the encoders are part of the trained model
        (:meth:`load_denoiser`)."""
        from transformers import CLIPTokenizer

        out: dict[str, Any] = {}
        for name in self.text_encoder_classes:
            tokenizer = _tokenizer_of(name)
            out[tokenizer] = CLIPTokenizer.from_pretrained(self.model_path, subfolder=tokenizer, **self._kwargs())
            if not self.config.train_text_encoder:
                encoder = self._load_text_encoder(name, dtype)
                out[name] = encoder.to(device=device).requires_grad_(False).eval()
        return out

    def _text_encoder_class(self, name: str) -> Any:
        return resolve_component_class("transformers", self.text_encoder_classes[name], "model")

    def _load_text_encoder(self, name: str, dtype: torch.dtype) -> Any:
        return self._text_encoder_class(name).from_pretrained(
            self.model_path, subfolder=name, dtype=dtype, use_safetensors=True, **self._kwargs()
        )

    def load_denoiser(self, dtype=torch.float32):
        """The UNet; with ``train_text_encoder``, the UNet and the text encoders in one
        :class:`~simpletuner.models.text_encoder_lora.UNetWithTextEncoders` (both in ``dtype``; said at start)."""
        from diffusers import UNet2DConditionModel

        unet = UNet2DConditionModel.from_pretrained(
            self.model_path, subfolder="unet", torch_dtype=dtype, use_safetensors=True, **self._kwargs()
        )
        if not self.config.train_text_encoder:
            return unet
        logger.info("%s", te_lora.describe(list(self.text_encoder_classes), self.config))
        return self._with_text_encoders(unet, {n: self._load_text_encoder(n, dtype) for n in self.text_encoder_classes})

    def denoiser_from_config(self) -> torch.nn.Module:
        """The denoiser :meth:`load_denoiser` gives, built from the folder's configs (no weights)."""
        unet = super().denoiser_from_config()
        if not self.config.train_text_encoder:
            return unet
        from transformers import AutoConfig

        encoders = {}
        for name in self.text_encoder_classes:
            encoders[name] = self._text_encoder_class(name)(
                AutoConfig.from_pretrained(self.model_path, subfolder=name, **self._kwargs())
            )
        return self._with_text_encoders(unet, encoders)

    def _with_text_encoders(self, unet: torch.nn.Module, encoders: dict[str, Any]) -> UNetWithTextEncoders:
        return UNetWithTextEncoders(unet, encoders, self.embed, self.unet_predict)

    def prepare_denoiser(self, denoiser: torch.nn.Module, weight_dtype: torch.dtype) -> torch.nn.Module:
        """The UNet's adapter (or full training), and with ``train_text_encoder`` a LoRA on each text encoder."""
        if not isinstance(denoiser, UNetWithTextEncoders):
            return super().prepare_denoiser(denoiser, weight_dtype)
        denoiser.unet = super().prepare_denoiser(denoiser.unet, weight_dtype)
        for name, encoder in denoiser.encoders().items():
            layers = encoder.config.num_hidden_layers - 1 if name in self.unread_last_layer else None
            denoiser.text_encoders[name] = te_lora.add_text_encoder_lora(encoder, self.config, weight_dtype, layers)
        return denoiser.train()

    def named_parameter_groups(self, denoiser: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
        """One group, or with ``train_text_encoder`` the UNet's (``default``) and the encoders' (``text_encoder``,
        at ``text_encoder_lr``)."""
        if not isinstance(denoiser, UNetWithTextEncoders):
            return super().named_parameter_groups(denoiser)
        encoders = [p for e in denoiser.text_encoders.values() for p in e.parameters() if p.requires_grad]
        return {
            "default": [p for p in denoiser.unet.parameters() if p.requires_grad],
            te_lora.TEXT_ENCODER_GROUP: encoders,
        }

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
        """The tokenizers' and text encoders' files; with ``train_text_encoder`` the tokenizers' alone, marked: the
        text cache then holds token ids (:meth:`encode_prompts`)."""
        if self.config.train_text_encoder:
            return fingerprint(token_ids=self._identity(*map(_tokenizer_of, self.text_encoder_classes)))
        return self._identity(*[folder for name in self.text_encoder_classes for folder in (_tokenizer_of(name), name)])

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
        """What the text cache keeps of each caption: its embeddings (:meth:`embed`), or with ``train_text_encoder``
        its token ids (the encoders train, so each step embeds its captions)."""
        ids = self.token_ids(text_encoders, captions)
        out = ids if self.config.train_text_encoder else self.embed(text_encoders, ids)
        return [{name: value[i] for name, value in out.items()} for i in range(len(captions))]

    def token_ids(self, tokenizers: Mapping[str, Any], captions: list[str]) -> dict[str, torch.Tensor]:
        """Each text encoder's token ids of ``captions`` (``[B, max_length]``, on the CPU), by conditioning entry
        (:func:`~simpletuner.models.text_encoder_lora.token_ids_key`)."""
        out = {}
        for name in self.text_encoder_classes:
            tokenizer = tokenizers[_tokenizer_of(name)]
            out[token_ids_key(name)] = tokenizer(
                captions,
                padding="max_length",
                max_length=tokenizer.model_max_length,
                truncation=True,
                return_tensors="pt",
            ).input_ids
        return out

    def embed(self, encoders: Mapping[str, Any], ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The UNet's text conditioning of token ids (:meth:`token_ids`): the encoder's last hidden state."""
        encoder = encoders["text_encoder"]
        return {"prompt_embeds": encoder(ids[token_ids_key("text_encoder")].to(encoder.device))[0]}

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
        """The denoiser's output for a noisy batch. With ``train_text_encoder`` the denoiser is a
        :class:`~simpletuner.models.text_encoder_lora.UNetWithTextEncoders` (perhaps inside DDP), which embeds the
        batch's token ids before :meth:`unet_predict`."""
        if self.config.train_text_encoder:
            return denoiser(noisy, timesteps, conditioning)
        return self.unet_predict(denoiser, noisy, timesteps, conditioning)

    def unet_predict(self, unet, noisy, timesteps, conditioning):
        """The UNet's output for a noisy batch: the one call that differs between UNet families."""
        return unet(noisy, timesteps, conditioning["prompt_embeds"], return_dict=False)[0]

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
        if self.config.train_text_encoder:
            return self.latent_shape(batch_size), self._token_id_shapes(batch_size)
        embeds = (batch_size, self._max_length("tokenizer", text), text["hidden_size"])
        return self.latent_shape(batch_size), {"prompt_embeds": embeds}

    def _token_id_shapes(self, batch_size: int) -> dict[str, tuple[int, ...]]:
        """``train_text_encoder``: a batch's token ids, per text encoder (what the text cache holds then)."""
        return {
            token_ids_key(name): (batch_size, self._max_length(_tokenizer_of(name), self._required_config(name)))
            for name in self.text_encoder_classes
        }

    # --- output --------------------------------------------------------------------------
    def lora_pipeline_class(self):
        """The diffusers pipeline whose ``save_lora_weights`` / ``load_lora_weights`` own the file format."""
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline

    def save_lora(self, output_dir, denoiser):
        """The UNet's LoRA and, with ``train_text_encoder``, each text encoder's, in one file under the keys the
        pipeline's ``load_lora_weights`` reads (``unet.``, ``text_encoder.``, ``text_encoder_2.``)."""
        from peft.utils import get_peft_model_state_dict

        unet = denoiser.unet if isinstance(denoiser, UNetWithTextEncoders) else denoiser
        encoders: dict[str, Any] = {}
        if isinstance(denoiser, UNetWithTextEncoders):
            for name, (layers, metadata) in te_lora.lora_layers_by_component(denoiser).items():
                encoders[f"{name}_lora_layers"], encoders[f"{name}_lora_adapter_metadata"] = layers, metadata
        # PEFT's keys as they are (lora_A / lora_B), which the pipeline's loader reads for any target module:
        # convert_state_dict_to_diffusers renames only the attention projections to the old `lora.down` form, and a
        # file mixing both forms (lora_target_modules with proj_in, say) loads only in part.
        self.lora_pipeline_class().save_lora_weights(
            save_directory=str(output_dir),
            unet_lora_layers=get_peft_model_state_dict(unet),
            unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(),
            safe_serialization=True,
            **encoders,
        )
        path = Path(output_dir) / "pytorch_lora_weights.safetensors"
        ordinary_permissions(path)  # safetensors (under diffusers) writes 0600
        return path

    def save_full(self, output_dir, denoiser):
        target = Path(output_dir) / self.denoiser_name
        denoiser.save_pretrained(target, safe_serialization=True)
        ordinary_permissions(target)
        return target

    def export_modules(self, denoiser):
        """The one adapter file's modules: the UNet's, and with ``train_text_encoder`` each text encoder's."""
        from simpletuner.models.adapters.export import modules_of

        if not isinstance(denoiser, UNetWithTextEncoders):
            return super().export_modules(denoiser)
        alpha = self.config.effective_lora_alpha
        modules = modules_of(denoiser.unet, self.denoiser_name, alpha)
        for name, encoder in denoiser.encoders().items():
            modules.update(modules_of(encoder, name, alpha))
        return [modules]

    def pipeline_parts(self, denoiser, text_encoders) -> tuple[Any, dict[str, Any]]:
        """The UNet and the text components a pipeline samples with: with ``train_text_encoder`` the encoders being
        trained (``text_encoders`` then holds the tokenizers)."""
        if isinstance(denoiser, UNetWithTextEncoders):
            return denoiser.unet, {**text_encoders, **denoiser.encoders()}
        return denoiser, text_encoders

    def build_pipeline(self, denoiser, vae, text_encoders):
        from diffusers import DDIMScheduler, StableDiffusionPipeline

        unet, text_encoders = self.pipeline_parts(denoiser, text_encoders)
        scheduler = DDIMScheduler.from_config(self.load_noise_scheduler().config, **self.sampling_scheduler_options())
        return StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            tokenizer=text_encoders["tokenizer"],
            unet=unet,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )


def _tokenizer_of(encoder_name: str) -> str:
    """The tokenizer component of a text encoder: ``text_encoder_2`` -> ``tokenizer_2``."""
    return "tokenizer" + encoder_name.removeprefix("text_encoder")
