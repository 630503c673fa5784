"""Text-encoder LoRA for the UNet families (``train_text_encoder``): a peft LoRA on each CLIP text encoder, trained
with the UNet's adapter inside one module (:class:`UNetWithTextEncoders`), so the trainer, DDP, checkpoints, the EMA
and the optimizer see one model, with an optimizer group of its own for the encoders (:data:`TEXT_ENCODER_GROUP`,
at ``text_encoder_lr``).

A trained encoder's embeddings change every step, so they are not cached: the text cache holds each caption's token
ids (:func:`token_ids_key`), and the module's forward encodes them with the trained encoders before the UNet runs,
in the one forward DDP sees. The family says how ids become the UNet's conditioning (``embed``) and how the UNet is
called (``predict``). Why this shape, and where SimpleTuner differs: documentation/MODEL_FAMILIES.md, "Training the
text encoders (sd, sdxl)".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from simpletuner.configuration import TrainingConfig

#: The modules of a CLIP text encoder the LoRA adapts: its attention projections, as diffusers'
#: train_dreambooth_lora.py / train_dreambooth_lora_sdxl.py adapt them.
TEXT_ENCODER_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
#: The optimizer group of the encoders' LoRA (``text_encoder_lr``; ``ModelSpec.named_parameter_groups``).
TEXT_ENCODER_GROUP = "text_encoder"
#: The conditioning entry holding a caption's token ids for ``text_encoder`` (``input_ids_2`` for ``text_encoder_2``).
TOKEN_IDS = "input_ids"

#: ``(encoders, token ids by entry name) -> the UNet's text conditioning`` (``prompt_embeds`` ...), with gradients.
Embed = Callable[[Mapping[str, nn.Module], Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
#: ``(unet, noisy latents, timesteps, conditioning) -> the UNet's prediction``.
Predict = Callable[[nn.Module, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def token_ids_key(encoder_name: str) -> str:
    """The conditioning entry of ``encoder_name``'s token ids: ``text_encoder`` -> ``input_ids``,
    ``text_encoder_2`` -> ``input_ids_2``."""
    return TOKEN_IDS + encoder_name.removeprefix("text_encoder")


def is_token_ids(name: str) -> bool:
    """Whether the conditioning entry ``name`` holds token ids (integers), not embeddings."""
    return name == TOKEN_IDS or name.startswith(TOKEN_IDS + "_")


def add_text_encoder_lora(
    encoder: PreTrainedModel, config: TrainingConfig, weight_dtype: torch.dtype, num_layers: int | None = None
) -> PreTrainedModel:
    """Freeze ``encoder`` in ``weight_dtype`` and add a trainable fp32 peft LoRA on
    :data:`TEXT_ENCODER_LORA_TARGETS`, with the UNet adapter's rank, alpha, dropout and DoRA setting (diffusers'
    training scripts share them too); gradient checkpointing as the config says; train mode. ``num_layers``: adapt
    only the first ``num_layers`` encoder layers, those whose output the family's conditioning reads (None: all). A
    LoRA that never reaches the loss would get no gradient, which DDP refuses.

    peft's ``inject_adapter_in_model`` rather than transformers' ``add_adapter``: the latter asks for a newer peft
    than the one diffusers trains with here; both leave the same layers and ``peft_config``."""
    from peft import LoraConfig, inject_adapter_in_model

    encoder.requires_grad_(False)
    encoder.to(dtype=weight_dtype)  # type: ignore[call-arg]  # transformers' @wraps(Module.to) drops `self` from its type
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.effective_lora_alpha,  # type: ignore[arg-type]  # peft says int; it divides by r (floats work)
        lora_dropout=config.lora_dropout,
        init_lora_weights="gaussian",
        target_modules=list(TEXT_ENCODER_LORA_TARGETS),
        use_dora=config.lora_use_dora,
        layers_to_transform=None if num_layers is None else list(range(num_layers)),
        layers_pattern=None if num_layers is None else "layers",
    )
    inject_adapter_in_model(lora, encoder, "default")
    for p in encoder.parameters():
        if p.requires_grad:  # adapters train in fp32 whatever the base precision, as the UNet's
            p.data = p.data.float()
    if config.gradient_checkpointing:
        # Non-reentrant, as torch advises: it needs no input that requires a gradient (the frozen embeddings' has none).
        encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return encoder.train()


class UNetWithTextEncoders(nn.Module):
    """The UNet and the text encoders being trained, behind one forward: ``forward(noisy, timesteps, conditioning)``
    encodes the token ids in ``conditioning`` (:func:`is_token_ids`) with the encoders (``embed``), then returns
    ``predict(unet, noisy, timesteps, conditioning with those embeddings)``. ``embed`` and ``predict`` are the
    family's (plain attributes: not modules, not saved)."""

    def __init__(self, unet: nn.Module, text_encoders: Mapping[str, nn.Module], embed: Embed, predict: Predict):
        super().__init__()
        self.unet = unet
        self.text_encoders = nn.ModuleDict(dict(text_encoders))
        self._embed, self._predict = embed, predict

    @property
    def config(self) -> Any:
        """The UNet's config: what export and the run identity read of a denoiser."""
        return self.unet.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.unet.parameters()).dtype

    def encoders(self) -> dict[str, PreTrainedModel]:
        """The trained text encoders by pipeline component name (``text_encoder``, ``text_encoder_2``)."""
        from transformers import PreTrainedModel

        found = {}
        for name, encoder in self.text_encoders.items():
            assert isinstance(encoder, PreTrainedModel)  # what the families put here (transformers' CLIP models)
            found[name] = encoder
        return found

    def compile_parts(self) -> None:
        """``torch.compile`` the UNet and each encoder in place (``enable_compile``): the forward between them is
        plain Python."""
        self.unet.compile()
        for encoder in self.text_encoders.values():
            encoder.compile()

    def forward(
        self, noisy: torch.Tensor, timesteps: torch.Tensor, conditioning: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        ids = {name: value for name, value in conditioning.items() if is_token_ids(name)}
        rest = {name: value for name, value in conditioning.items() if not is_token_ids(name)}
        return self._predict(self.unet, noisy, timesteps, {**rest, **self._embed(self.encoders(), ids)})


def lora_layers_by_component(model: UNetWithTextEncoders) -> dict[str, tuple[dict[str, torch.Tensor], dict]]:
    """Each trained text encoder's LoRA state (peft's keys as they are: ``lora_A`` / ``lora_B``) and adapter config
    (what ``save_lora_weights`` writes as ``<component>_lora_adapter_metadata``), by component name."""
    from peft import PeftConfig
    from peft.utils import get_peft_model_state_dict

    found: dict[str, tuple[dict[str, torch.Tensor], dict]] = {}
    for name, encoder in model.encoders().items():
        config = encoder.peft_config["default"]
        assert isinstance(config, PeftConfig)  # the LoraConfig add_text_encoder_lora injected
        found[name] = (get_peft_model_state_dict(encoder), config.to_dict())
    return found


def describe(names: list[str], config: TrainingConfig) -> str:
    """The start-up line of a run that trains ``names`` (said once, when the model loads)."""
    rate = config.text_encoder_lr if config.text_encoder_lr is not None else config.learning_rate
    return (
        f"train_text_encoder: a LoRA on {' and '.join(names)} ({', '.join(TEXT_ENCODER_LORA_TARGETS)}; rank "
        f"{config.lora_rank}, alpha {config.effective_lora_alpha:g}) trains with the UNet's at learning rate "
        f"{rate:g}; their embeddings change every step, so each step encodes its captions: the text cache holds "
        "their token ids, not embeddings"
    )
