"""The denoiser's training set-up, applied by the model specs: a frozen base (optionally quantised,
``quantize.py``) under a peft LoRA (``peft_lora.py``) or a LyCORIS network (``lycoris.py``, imported by
LyCORIS runs only), or full training; gradient checkpointing; TREAD token routing; train mode.

This is a model transformation, not loop code: ``models`` applies it, and ``training`` and ``memory``
import it from here (the memory estimator runs :func:`prepare_for_training` on a meta-device model).
"""

from __future__ import annotations

import torch
from torch import nn

from simpletuner.configuration import TrainingConfig
from simpletuner.models.adapters.peft_lora import add_peft_lora
from simpletuner.models.adapters.quantize import (
    check_adapter_support,
    parameter_bytes,
    quantize_base,
    quantized_size,
)
from simpletuner.models.tread import install_token_routing


def freeze_base(denoiser: nn.Module, base_dtype: torch.dtype) -> None:
    """Freeze every weight of ``denoiser`` and cast it to ``base_dtype`` (no-op where it is already)."""
    denoiser.requires_grad_(False)
    if denoiser.dtype != base_dtype:
        denoiser.to(dtype=base_dtype)


def prepare_for_training(
    denoiser: nn.Module,
    targets: list[str],
    config: TrainingConfig,
    weight_dtype: torch.dtype,
    device: torch.device | None = None,
) -> nn.Module:
    """The trainer's set-up of a loaded denoiser: an fp32 adapter (``lora_type``: peft LoRA or
    LyCORIS) on a frozen base in ``weight_dtype`` whose Linear weights ``base_model_precision`` may
    quantise first, or every weight trainable (full); gradient checkpointing if configured; TREAD token routing
    (``tread_config``, models/tread.py); train mode.

    ``device``: where quantised layers go as they are quantised (the GPU: fast, and the full-precision
    base never sits there whole); None quantises where the model is. The memory estimator calls
    this on a meta-device model (quantisation is then skipped and counted by the estimator), so
    estimate and run cannot drift.
    """
    from diffusers.models.modeling_utils import ModelMixin

    assert isinstance(denoiser, ModelMixin)  # every family's denoiser (Wan 2.2 passes each expert)
    if config.training_type == "lora":
        check_adapter_support(config.base_model_precision, config.lora_type, config.lora_use_dora)
        freeze_base(denoiser, weight_dtype)
        quantize_base(denoiser, config.base_model_precision, device)  # before the adapter wraps the layers
        if config.lora_type == "lycoris":
            from simpletuner.models.adapters.lycoris import apply_lycoris  # only LyCORIS runs import it

            apply_lycoris(denoiser, targets, config)
        else:
            denoiser = add_peft_lora(denoiser, targets, config)
    else:
        denoiser.requires_grad_(True)
    if config.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    if config.tread_config is not None:
        install_token_routing(denoiser, config.tread_config.routes)
    return denoiser.train()


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters being trained, by name (what a checkpoint must restore)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


__all__ = [
    "add_peft_lora",
    "freeze_base",
    "parameter_bytes",
    "prepare_for_training",
    "quantize_base",
    "quantized_size",
    "trainable_state",
]
