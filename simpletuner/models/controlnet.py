"""ControlNet training (``controlnet: true``; sdxl and flux): a ControlNet (full) or a peft LoRA on one (lora) is
trained beside the family's frozen denoiser, which takes the ControlNet's residuals, as diffusers' ControlNet
pipelines run them.

Both models live in one module, :class:`ControlledDenoiser`, so the trainer, DDP, checkpoints, the EMA and the
optimizer see one model whose trainable parameters are the ControlNet's; its forward is the family's
``controlled_predict(base, controlnet, ...)``. A fresh ControlNet is made from the base (``from_unet`` /
``from_transformer``) under the run's seed, so a resumed run rebuilds the same one. What a run writes
(:func:`save_controlnet_folder`, :func:`save_controlnet_lora`) and where SimpleTuner differs:
documentation/MODEL_FAMILIES.md, "ControlNet".
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from simpletuner.file_modes import ordinary_permissions
from simpletuner.models.adapters import freeze_base, prepare_for_training, quantize_base
from simpletuner.models.spec import ModelSpec

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin

    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)

#: The folder a ControlNet is saved in (under ``output_dir``, and in checkpoints), which
#: ``ControlNetModel.from_pretrained`` / ``FluxControlNetModel.from_pretrained`` load.
CONTROLNET_FOLDER = "controlnet"
#: The key prefix of the adapter file: ``ControlNetModel.load_lora_adapter(file, prefix="controlnet")`` reads it
#: (SimpleTuner's ``CONTROLNET_LORA_STATE_DICT_PREFIX``, common.py:452).
LORA_PREFIX = "controlnet"
#: The adapter file of a LoRA run.
LORA_FILE = "pytorch_lora_weights.safetensors"

#: ``(base, controlnet, *inputs) -> the base's prediction given the ControlNet's residuals``.
ControlledPredict = Callable[..., torch.Tensor]


class ControlledDenoiser(nn.Module):
    """The frozen ``base`` (UNet or transformer) and the ``controlnet`` being trained, behind one forward:
    ``forward(*inputs)`` returns ``predict(base, controlnet, *inputs)`` (the family's; a plain attribute, not
    saved). ``config`` is the base's (what the family's loss and the run identity read)."""

    def __init__(self, base: "ModelMixin", controlnet: "ModelMixin", predict: ControlledPredict):
        super().__init__()
        self.base: ModelMixin = base
        self.controlnet: ModelMixin = controlnet
        self._predict = predict

    @property
    def config(self) -> Any:
        return self.base.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.base.parameters()).dtype

    def compile_parts(self) -> None:
        """``torch.compile`` both models in place (``enable_compile``): the forward between them is plain Python."""
        self.base.compile()
        self.controlnet.compile()

    def forward(self, *inputs: Any) -> torch.Tensor:
        return self._predict(self.base, self.controlnet, *inputs)


def seeded(seed: int, make: Callable[[], "ModelMixin"]) -> "ModelMixin":
    """``make()`` with torch's global RNG seeded by ``seed`` and put back after: a fresh ControlNet's randomly
    initialised layers (SDXL's conditioning embedding) come out the same in a resumed run."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def prepare_controlled(
    model: ControlledDenoiser, targets: list[str], config: "TrainingConfig", weight_dtype: torch.dtype
) -> ControlledDenoiser:
    """Freeze the base in ``weight_dtype`` (``base_model_precision`` quantises it in a LoRA run) and set up the
    ControlNet as any trained denoiser (:func:`~simpletuner.models.adapters.prepare_for_training`: a peft LoRA on
    ``targets``, or every weight trainable; gradient checkpointing)."""
    freeze_base(model.base, weight_dtype)
    if config.training_type == "lora":
        quantize_base(model.base, config.base_model_precision, None)
    if config.gradient_checkpointing:
        model.base.enable_gradient_checkpointing()
    prepare_for_training(model.controlnet, targets, config, weight_dtype)  # in place
    return model.train()


def save_controlnet_folder(output_dir: Path, controlnet: "ModelMixin") -> Path:
    """``output_dir/controlnet``: the ControlNet as a diffusers folder (safetensors), a LoRA merged into its
    weights (:func:`merged_controlnet`); returns the folder."""
    target = Path(output_dir) / CONTROLNET_FOLDER
    merged_controlnet(controlnet).save_pretrained(target, safe_serialization=True)
    ordinary_permissions(target)
    return target


def merged_controlnet(controlnet: "ModelMixin") -> "ModelMixin":
    """``controlnet`` itself when it has no adapter; else a new model of its class and config (on the CPU) holding
    its weights with the peft LoRA added in, which ``from_pretrained`` loads as a plain ControlNet. Weights that
    ``base_model_precision`` quantised (the ControlNet's frozen layers are, as SimpleTuner quantises them) are
    dequantised first: the folder holds plain weights in the model's dtype."""
    if not getattr(controlnet, "peft_config", None):
        return controlnet
    from peft.tuners.lora import LoraLayer

    cls: Any = type(controlnet)  # a ConfigMixin too (ControlNetModel, FluxControlNetModel)
    plain = cls.from_config(controlnet.config)
    wanted = plain.state_dict()
    state: dict[str, torch.Tensor] = {}
    for module_name, module in controlnet.named_modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            key = f"{module_name}.{name}".replace(".base_layer.", ".").lstrip(".")
            if key in wanted:  # not the adapter's own weights, nor a quantiser's scales
                state[key] = _plain(tensor).to("cpu", wanted[key].dtype)
    for module_name, module in controlnet.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            key = f"{module_name}.weight"
            layer: Any = module  # get_delta_weight is each layer kind's (Linear, Conv2d), not LoraLayer's
            delta = layer.get_delta_weight("default").detach()
            state[key] = state[key] + delta.to("cpu", state[key].dtype)
    plain.load_state_dict(state)  # strict: every weight of the plain model accounted for
    return plain


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor of ``tensor``'s values (a quantised weight dequantised)."""
    dequantize = getattr(tensor, "dequantize", None)
    value = dequantize() if callable(dequantize) and type(tensor) not in (torch.Tensor, nn.Parameter) else tensor
    return value.detach()


def save_controlnet_lora(output_dir: Path, controlnet: "ModelMixin") -> Path:
    """The ControlNet's peft LoRA as one safetensors file, keys ``controlnet.<peft key>`` with its adapter config
    as metadata (what ``ControlNetModel`` / ``FluxControlNetModel.load_lora_adapter(file, prefix="controlnet")``
    reads onto the ControlNet it was trained on); returns the file."""
    from diffusers.loaders.lora_base import LoraBaseMixin
    from peft.utils import get_peft_model_state_dict

    LoraBaseMixin._save_lora_weights(
        save_directory=str(output_dir),
        lora_layers={LORA_PREFIX: get_peft_model_state_dict(controlnet)},
        lora_metadata={LORA_PREFIX: controlnet.peft_config["default"].to_dict()},
        weight_name=LORA_FILE,
        safe_serialization=True,
    )
    path = Path(output_dir) / LORA_FILE
    ordinary_permissions(path)  # safetensors (under diffusers) writes 0600
    return path


def save_controlled(output_dir: Path, model: nn.Module, full: bool) -> Path:
    """A run's ControlNet weights: the ControlNet folder (full; returned), or the adapter file (returned) and the
    ControlNet folder with the LoRA merged (lora), which the diffusers ControlNet pipelines load as it is."""
    assert isinstance(model, ControlledDenoiser)  # what the ControlNet specs train
    folder = save_controlnet_folder(output_dir, model.controlnet)
    return folder if full else save_controlnet_lora(output_dir, model.controlnet)


class ControlNetTraining(ModelSpec):
    """What the ControlNet specs share, first in their bases (``class StableDiffusionXLControlNetSpec(
    ControlNetTraining, StableDiffusionXLSpec)``): image pairs (the conditioning image, never in the prompt), the
    frozen base and the trained ControlNet (:func:`prepare_controlled`), and what a run writes
    (:func:`save_controlled`; checkpoints hold the ControlNet folder too)."""

    conditions_on_image = True  # each image pairs with a conditioning image (the data and validation contract)
    prompt_sees_source = False  # the prompt is the caption alone
    checkpoints_hold_full_weights = True  # checkpoint-N/controlnet, as SimpleTuner's save hooks write it

    def prepare_denoiser(self, denoiser, weight_dtype):
        """The base frozen, the ControlNet trained (:func:`prepare_controlled`)."""
        assert isinstance(denoiser, ControlledDenoiser)  # what the ControlNet specs load
        return prepare_controlled(denoiser, self.lora_targets, self.config, weight_dtype)

    def save_lora(self, output_dir, denoiser):
        return save_controlled(output_dir, denoiser, full=False)

    def save_full(self, output_dir, denoiser):
        return save_controlled(output_dir, denoiser, full=True)

    def export_modules(self, denoiser):
        return []  # output_formats other than diffusers are refused for a ControlNet (configuration rules)
