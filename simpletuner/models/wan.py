"""Wan 2.1 text-to-video: one WanTransformer3DModel, the causal 3-D AutoencoderKLWan and a UMT5 text encoder.
Image datasets train as 1-frame video.

Latents are cached ``[C, F, h, w]`` per sample, normalised per channel as ``WanPipeline`` inverts before
decoding; conditioning is ``WanPipeline.encode_prompt``'s, cached per caption. Rectified flow
(``FlowMatchingSpec.flow_loss``). A Wan 2.2 folder (:func:`read_boundary_ratio`) gets
:class:`simpletuner.models.wan22.Wan22Spec`, chosen by the family registry. Shapes and the shift:
documentation/MODEL_FAMILIES.md, "Wan 2.1".
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from simpletuner.configuration import TrainingConfig
from simpletuner.models.flow import FlowMatchingSpec
from simpletuner.models.spec import read_model_index, resolve_component_class, save_transformer_lora

#: UMT5 tokens per caption: WanPipeline.__call__'s default ``max_sequence_length``.
WAN_MAX_LENGTH = 512
_T5_TOKENIZERS = frozenset({"T5Tokenizer", "T5TokenizerFast", "AutoTokenizer"})
_TEXT_ENCODERS = {"UMT5EncoderModel", "T5EncoderModel"}


def boundary_ratio_of(index: dict[str, Any] | None, index_file: Path) -> float | None:
    """``boundary_ratio`` of a Wan pipeline's ``model_index.json`` (``index``, read from
    ``index_file``) when it names a second expert; None for Wan 2.1 (or no index).

    Raises:
        ValueError: a second expert without a boundary in (0, 1).
    """
    if index is None or index.get("transformer_2") in (None, [None, None]):
        return None
    ratio = index.get("boundary_ratio")
    if not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise ValueError(
            f"{index_file} has a second expert (transformer_2) but boundary_ratio is {ratio!r}, not a number in "
            "(0, 1): a Wan 2.2 folder says where the high-noise expert hands over (0.875 for T2V-A14B)"
        )
    return float(ratio)


def read_boundary_ratio(model_path: str | Path) -> float | None:
    """``boundary_ratio`` of a local Wan pipeline folder when it has a second expert; None for Wan 2.1
    or a hub id. Used to pick the family's variant before a spec exists.

    Raises:
        ValueError: the folder's ``model_index.json`` is not a JSON object (the message the folder
            check gives), or names a second expert without a boundary in (0, 1).
    """
    root = Path(model_path).expanduser()
    index = read_model_index(root) if root.is_dir() else None
    return boundary_ratio_of(index, root / "model_index.json")


class WanSpec(FlowMatchingSpec):
    """Wan 2.1 T2V (single transformer), flow matching; images are 1-frame videos."""

    family = "wan"
    # Self- and cross-attention projections of every block (attn1 / attn2): SimpleTuner's Wan default
    # (helpers/models/wan/model.py:286); diffusers has no Wan LoRA training script. Wan 2.2's experts take the same.
    default_lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]
    denoiser_name = "transformer"
    #: Padded caption length (WanPipeline.__call__'s default).
    max_sequence_length = WAN_MAX_LENGTH
    components = {
        "transformer": ("model", "diffusers", frozenset({"WanTransformer3DModel"})),
        "transformer_2": ("model", "diffusers", frozenset({"WanTransformer3DModel"})),  # Wan 2.2 only; null in 2.1
        "vae": ("model", "diffusers", frozenset({"AutoencoderKLWan"})),
        "text_encoder": ("model", "transformers", frozenset(_TEXT_ENCODERS)),
        "tokenizer": ("tokenizer", "transformers", _T5_TOKENIZERS),
        "scheduler": ("scheduler", "diffusers", re.compile(r"[A-Z][A-Za-z0-9]*Scheduler")),
    }

    def __init__(self, config: TrainingConfig):
        super().__init__(config)
        if config.train_stages != "both" and not self.has_experts:
            raise ValueError(
                f"train_stages {config.train_stages!r} picks one expert of Wan 2.2, but {self.model_path} is a "
                "one-transformer (Wan 2.1) folder: remove train_stages, or point pretrained_model_name_or_path at a "
                "Wan 2.2 folder (transformer and transformer_2)"
            )

    def _check_index_entry(self, index_file, name, entry, library, allowed):
        if name == "transformer_2" and entry in (None, [None, None]):
            return  # Wan 2.1: no low-noise expert
        super()._check_index_entry(index_file, name, entry, library, allowed)

    #: Validation videos play at 16 fps, as the diffusers Wan pipelines' examples export them
    #: (``export_to_video(output, "output.mp4", fps=16)``) and as SimpleTuner's ``framerate`` default.
    video_fps = 16

    # --- latent grid ---------------------------------------------------------------------
    latent_patch = 2  # WanTransformer3DModel's patch_size (1, 2, 2): 2x2 latents per token

    def vae_scale_from_folder(self) -> int | None:
        vae = self._component_config("vae")
        if not vae:
            return None
        scale = vae.get("scale_factor_spatial") or 2 ** (len(vae.get("dim_mult") or [1, 2, 4, 4]) - 1)
        return scale if isinstance(scale, int) and scale > 0 else None

    def positions_per_side(self):
        most = (self._component_config(self.denoiser_name) or {}).get("rope_max_seq_len", 1024)
        return (most, "rope_max_seq_len") if isinstance(most, int) and most > 0 else None

    def check_positions(self) -> None:
        """Also the frames: a clip's latent frames are tokens along time, with the same rotary limit."""
        super().check_positions()
        limit = self.positions_per_side()
        vae = self._component_config("vae") or {}
        temporal = vae.get("scale_factor_temporal") or 4
        if limit is None or not isinstance(temporal, int) or temporal < 1:
            return
        most, key = limit
        for i, ds in enumerate(self.config.datasets or []):
            frames = ds.num_frames if ds.dataset_type == "video" and ds.num_frames else 1
            latent_frames = (frames - 1) // temporal + 1
            if latent_frames > most:
                raise ValueError(
                    f"datasets[{i}].num_frames {frames} gives {latent_frames} latent frames, but the wan denoiser in "
                    f"{self.model_path} has positions for {most} along time ({key} in its config): use num_frames "
                    f"of at most {(most - 1) * temporal + 1}"
                )

    def latent_patch_from_folder(self) -> int:
        patch = (self._component_config(self.denoiser_name) or {}).get("patch_size")
        if isinstance(patch, list) and len(patch) == 3 and isinstance(patch[1], int) and patch[1] > 0:
            return patch[1]  # (frames, height, width): the spatial patch
        return self.latent_patch

    # --- loading -------------------------------------------------------------------------
    def _scheduler_config(self) -> dict[str, Any]:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return dict(
            FlowMatchEulerDiscreteScheduler.load_config(self.model_path, subfolder="scheduler", **self._kwargs())
        )

    @property
    def shift(self) -> float:
        """``flow_shift`` when set, else the folder scheduler's ``flow_shift`` (UniPC) or ``shift`` (Euler), else 1."""
        if self.config.flow_shift is not None:
            return float(self.config.flow_shift)
        cfg = self._scheduler_config()
        for key in ("flow_shift", "shift"):
            if cfg.get(key) is not None:
                return float(cfg[key])
        return 1.0

    def load_noise_scheduler(self):
        """The training schedule: Euler flow matching with the folder's timestep count (only that is read)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        if self._scheduler is None:
            cfg = self._scheduler_config()
            self._scheduler = FlowMatchEulerDiscreteScheduler(
                num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)), shift=self.shift
            )
        return self._scheduler

    def load_vae(self, device, dtype):
        from diffusers import AutoencoderKLWan

        vae = AutoencoderKLWan.from_pretrained(
            **self.vae_location().pretrained_args(), torch_dtype=dtype, use_safetensors=True
        )
        return vae.to(device=device).requires_grad_(False).eval()

    def _text_encoder_class(self):
        entry = (self.model_index or {}).get("text_encoder")
        name = (
            entry[1]
            if isinstance(entry, list) and len(entry) == 2 and entry[1] in _TEXT_ENCODERS
            else "UMT5EncoderModel"
        )
        return resolve_component_class("transformers", name, "model")  # one of the two allowed names

    def load_text_encoders(self, device, dtype):
        from transformers import T5Tokenizer

        tokenizer = T5Tokenizer.from_pretrained(self.model_path, subfolder="tokenizer", **self._kwargs())
        encoder = self._text_encoder_class().from_pretrained(
            self.model_path, subfolder="text_encoder", dtype=dtype, use_safetensors=True, **self._kwargs()
        )
        return {"tokenizer": tokenizer, "text_encoder": encoder.to(device=device).requires_grad_(False).eval()}

    def load_denoiser(self, dtype=torch.float32):
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel.from_pretrained(
            self.model_path, subfolder="transformer", torch_dtype=dtype, use_safetensors=True, **self._kwargs()
        )

    def text_encoder_identity(self) -> str:
        return self._identity("tokenizer", "text_encoder")

    # --- encoding ------------------------------------------------------------------------
    @staticmethod
    def _stats(vae, latents):
        shape = (1, vae.config.z_dim) + (1,) * (latents.ndim - 2)
        mean = torch.tensor(vae.config.latents_mean, dtype=latents.dtype, device=latents.device).view(shape)
        std = torch.tensor(vae.config.latents_std, dtype=latents.dtype, device=latents.device).view(shape)
        return mean, std

    @torch.no_grad()
    def encode_images(self, vae, pixels):
        """[B, 3, H, W] images (or [B, 3, F, H, W] clips) in [-1, 1] -> normalised [B, C, F', h, w]."""
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)  # one frame
        pixels = pixels.to(device=vae.device, dtype=vae.dtype)
        latents = vae.encode(pixels).latent_dist.mode()
        mean, std = self._stats(vae, latents)
        return (latents - mean) / std

    @torch.no_grad()
    def encode_prompts(self, text_encoders, captions):
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tokenizer, encoder = text_encoders["tokenizer"], text_encoders["text_encoder"]
        length = self.max_sequence_length
        inputs = tokenizer(
            [prompt_clean(c) for c in captions],
            padding="max_length",
            max_length=length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = inputs.attention_mask.to(encoder.device)
        hidden = encoder(inputs.input_ids.to(encoder.device), mask).last_hidden_state
        # The pipeline keeps the first mask.sum() positions and zero-pads the rest.
        keep = (torch.arange(length, device=hidden.device)[None, :] < mask.gt(0).sum(dim=1, keepdim=True)).unsqueeze(-1)
        hidden = torch.where(keep, hidden, torch.zeros_like(hidden))
        return [{"prompt_embeds": e} for e in hidden]

    # --- training ------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning):
        return denoiser(
            hidden_states=noisy,
            timestep=timesteps,
            encoder_hidden_states=conditioning["prompt_embeds"],
            return_dict=False,
        )[0]

    # --- memory estimate -----------------------------------------------------------------
    def latent_shape(self, batch_size: int, frames: int = 1) -> tuple[int, ...]:
        vae = self._required_config("vae")
        spatial = int(vae.get("scale_factor_spatial") or 2 ** (len(vae.get("dim_mult", [1, 2, 4, 4])) - 1))
        temporal = int(vae.get("scale_factor_temporal") or 4)
        side = self.config.resolution // spatial
        return (batch_size, int(vae.get("z_dim", 16)), (frames - 1) // temporal + 1, side, side)

    def batch_shapes(self, batch_size):
        """At the longest clip of the config's video datasets (1 frame for images)."""
        text = self._required_config("text_encoder")
        frames = max((d.num_frames for d in self.config.datasets or [] if d.dataset_type == "video"), default=1)
        return (
            self.latent_shape(batch_size, frames),
            {"prompt_embeds": (batch_size, self.max_sequence_length, int(text["d_model"]))},
        )

    # --- output --------------------------------------------------------------------------
    def save_lora(self, output_dir, denoiser):
        from diffusers import WanPipeline

        return save_transformer_lora(WanPipeline, output_dir, denoiser)

    def build_pipeline(self, denoiser, vae, text_encoders):
        """A sampler with the image-pipeline call the validation loop makes (``.images``, PIL):
        a 1-frame WanPipeline run; the scheduler is the folder's (UniPC or Euler) at the training shift."""
        from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline

        cfg = self._scheduler_config()
        if cfg.get("_class_name") == "UniPCMultistepScheduler":
            scheduler = UniPCMultistepScheduler.from_config(cfg, flow_shift=self.shift)
        else:
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(cfg, shift=self.shift)
        pipe = WanPipeline(
            tokenizer=text_encoders["tokenizer"],
            text_encoder=text_encoders["text_encoder"],
            vae=vae,
            scheduler=scheduler,
            transformer=denoiser,
        )
        return WanImageSampler(pipe, self.max_sequence_length)


class WanImageSampler:
    """``WanPipeline`` called as an image pipeline: one frame per sample, returned as ``.images``."""

    def __init__(self, pipe, max_sequence_length: int = WAN_MAX_LENGTH):
        self.pipe = pipe
        self.max_sequence_length = max_sequence_length

    def set_progress_bar_config(self, **kwargs):
        self.pipe.set_progress_bar_config(**kwargs)

    def __call__(self, prompt, num_images_per_prompt: int = 1, num_frames: int = 1, **kwargs):
        """``.images``: each video's first frame; ``.frames``: the videos (``num_frames`` frames each)."""
        kwargs.setdefault("max_sequence_length", self.max_sequence_length)
        videos = self.pipe(
            prompt, num_videos_per_prompt=num_images_per_prompt, num_frames=num_frames, output_type="pil", **kwargs
        ).frames
        return SimpleNamespace(images=[video[0] for video in videos], frames=videos)
