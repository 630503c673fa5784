"""ModelSpec: what the trainer needs from a model family, and nothing family-specific beyond it.

A family module implements loading from a diffusers-format folder, prompt and image encoding
for the caches, the training loss (noise, timesteps, target) and adapter saving. The trainer
only talks to this interface, so adding a family never adds an ``if family == ...`` branch.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig


class ModelSpec(abc.ABC):
    """One diffusion-model family. Instances are cheap; components load on request."""

    family: ClassVar[str]
    #: Module names LoRA adapts when ``lora_target_modules`` is not set.
    default_lora_targets: ClassVar[list[str]]
    #: Name of the trained component inside the pipeline folder (``unet``, ``transformer``).
    denoiser_name: ClassVar[str]

    def __init__(self, config: "TrainingConfig"):
        self.config = config
        self.model_path = config.pretrained_model_name_or_path

    # --- loading -------------------------------------------------------------------------
    @abc.abstractmethod
    def load_noise_scheduler(self) -> Any:
        """The training noise scheduler (e.g. DDPMScheduler)."""

    @abc.abstractmethod
    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The image encoder/decoder, frozen, in eval mode."""

    @abc.abstractmethod
    def load_text_encoders(self, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """Tokenizers and text encoders, frozen, keyed by their pipeline names."""

    @abc.abstractmethod
    def load_denoiser(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The model that is trained (UNet or transformer)."""

    # --- identities used in cache keys ---------------------------------------------------
    @abc.abstractmethod
    def image_encoder_identity(self) -> str:
        """Changes whenever the VAE weights or config change."""

    @abc.abstractmethod
    def text_encoder_identity(self) -> str:
        """Changes whenever any tokenizer or text encoder changes."""

    # --- encoding (cache filling) --------------------------------------------------------
    @abc.abstractmethod
    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1], shape [B, 3, H, W] -> scaled latents [B, C, h, w]."""

    @abc.abstractmethod
    def encode_prompts(self, text_encoders: dict[str, Any], captions: list[str]) -> list[dict[str, torch.Tensor]]:
        """One dict of conditioning tensors per caption (e.g. ``prompt_embeds``)."""

    # --- training ------------------------------------------------------------------------
    @abc.abstractmethod
    def training_loss(
        self,
        denoiser: nn.Module,
        latents: torch.Tensor,
        conditioning: dict[str, torch.Tensor],
        generator: torch.Generator,
    ) -> torch.Tensor:
        """Per-sample loss, shape [B] (the trainer sums and normalises over the window)."""

    # --- output --------------------------------------------------------------------------
    @abc.abstractmethod
    def save_lora(self, output_dir: Path, denoiser: nn.Module) -> Path:
        """Write the adapter in the format the family's diffusers pipeline loads; returns the file."""

    @abc.abstractmethod
    def save_full(self, output_dir: Path, denoiser: nn.Module) -> Path:
        """Write the fully fine-tuned denoiser as a diffusers folder; returns it."""

    @abc.abstractmethod
    def build_pipeline(self, denoiser: nn.Module, vae: nn.Module, text_encoders: dict[str, Any]) -> Any:
        """A diffusers pipeline for sampling with the model being trained."""

    @property
    def lora_targets(self) -> list[str]:
        return list(self.config.lora_target_modules or self.default_lora_targets)
