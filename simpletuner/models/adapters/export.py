"""The trained LoRA under the key names kohya-ss' trainers and ComfyUI use: the diffusers-format file read into its
modules (:func:`read_diffusers_lora`), renamed per family and format (:func:`export_state_dict`, the writers of
:mod:`.lora_names`) and written by :func:`export_file`.

The scale rule: a module's LoRA adds ``up @ down * alpha / rank``. Files with ``.alpha`` tensors carry the run's
alpha per module, written as a float32 scalar (float64 where float32 does not hold it exactly), so every reader
computes the same scale; a fused kohya module (Flux's ``qkv`` / ``linear1``) of ``n`` parts has rank ``n * rank``
and alpha ``n * alpha``. ComfyUI's sd3 file has no alpha key (diffusers refuses one there): the scale is folded
into the weights. No file carries diffusers' adapter metadata: a reader would apply its alpha on top.

Modules a format's reader does not map the same way back are refused by name (:class:`ExportError`); modules a
reader requires and the run did not train (every block's attention and feed-forward for musubi's Wan reader, the
fourth part of Flux's fused ``linear1``) are written as zero LoRAs, which change nothing. Which (family, format)
pairs exist: :mod:`simpletuner.configuration.export_formats`; why each naming: documentation/MODEL_FAMILIES.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from simpletuner.configuration.export_formats import NOT_WRITTEN
from simpletuner.file_modes import ordinary_permissions
from simpletuner.models.adapters.lora_names import WRITERS, ExportError, LoraModule, Modules

#: The safetensors metadata entry diffusers writes the peft config of each component under.
ADAPTER_METADATA = "lora_adapter_metadata"
_DOWN = (".lora.down.weight", ".lora_A.weight", ".lora_linear_layer.down.weight")
_UP = (".lora.up.weight", ".lora_B.weight", ".lora_linear_layer.up.weight")
#: The marker an exported file's name carries before ``.safetensors`` (:func:`export_name`).


def export_name(weight_name: str, fmt: str) -> str:
    """The exported file's name beside the diffusers one: ``pytorch_lora_weights.safetensors`` ->
    ``pytorch_lora_weights.comfyui.safetensors``."""
    return f"{weight_name.removesuffix('.safetensors')}.{fmt}.safetensors"


def read_diffusers_lora(path: str | Path) -> Modules:
    """The LoRA modules of a diffusers-format adapter file (``save_lora_weights``), each with its alpha from the
    file's adapter metadata (none: alpha = rank, as diffusers loads such a file).

    Raises:
        ExportError: tensors that are not a plain LoRA's (DoRA magnitudes, biases), a module without both halves,
            or metadata with per-module patterns or rsLoRA (not written by simpletuner).
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        metadata = handle.metadata() or {}
    config = json.loads(metadata.get(ADAPTER_METADATA, "{}"))
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        side, name = _split_key(key)
        if side is None:
            raise ExportError(f"{path}: {key} is not the down or up weight of a plain LoRA (DoRA, bias?)")
        halves.setdefault(name, {})[side] = tensor
    modules: Modules = {}
    for name, pair in sorted(halves.items()):
        if set(pair) != {"down", "up"}:
            raise ExportError(f"{path}: {name} has no {'up' if 'down' in pair else 'down'} weight")
        component = name.split(".", 1)[0]
        modules[name] = LoraModule(pair["down"], pair["up"], _alpha(config, component, pair["down"].shape[0], path))
    return modules


def modules_of(model: torch.nn.Module, component: str, alpha: float) -> Modules:
    """The LoRA modules of a peft-adapted ``model`` (its ``default`` adapter) named as in its diffusers file
    (``<component>.<module path>``), each with ``alpha``: what :func:`export_state_dict` can be asked before training
    (the weights are not copied)."""
    from peft.tuners.lora import LoraLayer

    found: Modules = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            down, up = module.lora_A["default"].weight, module.lora_B["default"].weight
            assert isinstance(down, torch.Tensor) and isinstance(up, torch.Tensor)  # peft's Linear / Conv halves
            found[f"{component}.{name}"] = LoraModule(down.detach(), up.detach(), alpha)
    return found


def _split_key(key: str) -> tuple[str | None, str]:
    for side, suffixes in (("down", _DOWN), ("up", _UP)):
        for suffix in suffixes:
            if key.endswith(suffix):
                return side, key.removesuffix(suffix)
    return None, key


def _alpha(config: Mapping[str, Any], component: str, rank: int, path: str | Path) -> float:
    for pattern in ("alpha_pattern", "rank_pattern"):
        if config.get(f"{component}.{pattern}"):
            raise ExportError(f"{path}: {component}'s adapter has a {pattern}, which export does not carry")
    if config.get(f"{component}.use_rslora"):
        raise ExportError(
            f"{path}: {component}'s adapter is rsLoRA (scale alpha / sqrt(rank)), which these formats lack"
        )
    alpha = config.get(f"{component}.lora_alpha")
    return float(rank if alpha is None else alpha)


def denoiser_config_of(config: Any) -> dict[str, Any] | None:
    """The denoiser config export reads from a model's ``config`` (Wan 2.2's experts nest theirs, alike in what
    export reads, under ``transformer`` / ``transformer_2``); None when there is none."""
    if not isinstance(config, Mapping):
        return None
    nested = config.get("transformer")
    return dict(nested) if isinstance(nested, Mapping) else dict(config)


def export_state_dict(
    modules: Modules, family: str, fmt: str, denoiser_config: Mapping[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """``modules`` (:func:`read_diffusers_lora`) under ``fmt``'s names for ``family`` (:data:`WRITERS`).
    ``denoiser_config``: the denoiser's diffusers config, which :data:`NEEDS_DENOISER_CONFIG` pairs need.

    Raises:
        ExportError: the family has no such format, or a module has no name there that diffusers maps back.
    """
    if not modules:
        raise ExportError("the adapter file holds no LoRA modules")
    if (family, fmt) in NOT_WRITTEN:
        raise ExportError(NOT_WRITTEN[(family, fmt)])
    if (family, fmt) not in WRITERS:
        raise ExportError(f"no {fmt} format for model family {family!r}")
    return WRITERS[(family, fmt)](modules, denoiser_config or {})


def export_file(
    source: str | Path,
    target: str | Path,
    family: str,
    fmt: str,
    denoiser_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write the diffusers-format adapter ``source`` as ``fmt`` to ``target`` (a temp file renamed into place);
    returns ``target``. Raises ExportError as :func:`export_state_dict`."""
    from safetensors.torch import save_file

    state = export_state_dict(read_diffusers_lora(source), family, fmt, denoiser_config)
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in state.items()}, str(temp), metadata={"format": "pt"})
    ordinary_permissions(temp)  # safetensors writes 0600
    os.replace(temp, target)
    return target
