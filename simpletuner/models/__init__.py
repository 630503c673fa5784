"""Model families behind the ModelSpec contract (tiny random-weight ones to test with: simpletuner.testing.zoo).

A family's module is imported when its spec class is first looked up (``MODEL_FAMILIES[name]``,
:func:`get_model_spec`, ``from simpletuner.models import FluxSpec``): a run imports its own family only.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable

from simpletuner.models.library_probes import quiet_model_libraries

quiet_model_libraries()  # before any model library loads: no torchao unless a config quantises with it

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.models.flux import FluxSpec
    from simpletuner.models.flux_controlnet import FluxControlNetSpec
    from simpletuner.models.flux_kontext import FluxKontextSpec
    from simpletuner.models.qwen_image import QwenImageSpec
    from simpletuner.models.qwen_image_edit import QwenImageEditSpec
    from simpletuner.models.sd import StableDiffusionSpec
    from simpletuner.models.sd3 import StableDiffusion3Spec
    from simpletuner.models.sdxl import StableDiffusionXLSpec
    from simpletuner.models.sdxl_controlnet import StableDiffusionXLControlNetSpec
    from simpletuner.models.spec import ModelSpec
    from simpletuner.models.wan import WanSpec
    from simpletuner.models.wan22 import Wan22Spec
    from simpletuner.models.wan22_i2v import Wan22I2VSpec
    from simpletuner.models.wan22_ti2v import Wan22TI2VSpec

#: Every spec class this package names, as "module:Class": imported on first lookup (see :func:`__getattr__`).
_SPEC_CLASSES: dict[str, str] = {
    "ModelSpec": "simpletuner.models.spec:ModelSpec",
    "StableDiffusionSpec": "simpletuner.models.sd:StableDiffusionSpec",
    "StableDiffusionXLSpec": "simpletuner.models.sdxl:StableDiffusionXLSpec",
    "StableDiffusionXLControlNetSpec": "simpletuner.models.sdxl_controlnet:StableDiffusionXLControlNetSpec",
    "StableDiffusion3Spec": "simpletuner.models.sd3:StableDiffusion3Spec",
    "FluxSpec": "simpletuner.models.flux:FluxSpec",
    "FluxKontextSpec": "simpletuner.models.flux_kontext:FluxKontextSpec",
    "FluxControlNetSpec": "simpletuner.models.flux_controlnet:FluxControlNetSpec",
    "WanSpec": "simpletuner.models.wan:WanSpec",
    "Wan22Spec": "simpletuner.models.wan22:Wan22Spec",
    "Wan22I2VSpec": "simpletuner.models.wan22_i2v:Wan22I2VSpec",
    "Wan22TI2VSpec": "simpletuner.models.wan22_ti2v:Wan22TI2VSpec",
    "QwenImageSpec": "simpletuner.models.qwen_image:QwenImageSpec",
    "QwenImageEditSpec": "simpletuner.models.qwen_image_edit:QwenImageEditSpec",
}

#: Family name (the config's ``model_family``; a test keeps the keys equal to
#: ``simpletuner.configuration.families.FAMILIES`` and each to its class's own ``family``) -> the name of its
#: ModelSpec class (the base of a family with variants) in :data:`_SPEC_CLASSES`.
_FAMILY_SPECS: dict[str, str] = {
    "sd": "StableDiffusionSpec",
    "sdxl": "StableDiffusionXLSpec",
    "sd3": "StableDiffusion3Spec",
    "flux": "FluxSpec",
    "wan": "WanSpec",
    "qwen_image": "QwenImageSpec",
}


def _spec_class(name: str) -> type[ModelSpec]:
    """The spec class ``name`` (a key of :data:`_SPEC_CLASSES`), its module imported now if not yet."""
    module, _, attr = _SPEC_CLASSES[name].partition(":")
    cls: type[ModelSpec] = getattr(importlib.import_module(module), attr)
    return cls


class _FamilyTable(Mapping[str, "type[ModelSpec]"]):
    """:data:`MODEL_FAMILIES`: the names cost nothing; a value imports its family's module."""

    def __getitem__(self, family: str) -> type[ModelSpec]:
        return _spec_class(_FAMILY_SPECS[family])

    def __iter__(self) -> Iterator[str]:
        return iter(_FAMILY_SPECS)

    def __len__(self) -> int:
        return len(_FAMILY_SPECS)


#: Family name -> its ModelSpec class (the base of a family with variants), read-only, in the order of
#: ``simpletuner.configuration.families.FAMILIES``.
MODEL_FAMILIES: Mapping[str, type[ModelSpec]] = _FamilyTable()


def __getattr__(name: str) -> Any:
    """``simpletuner.models.FluxSpec`` and the other spec classes, imported on first use (PEP 562)."""
    if name in _SPEC_CLASSES:
        return _spec_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _wan_variant(config: "TrainingConfig") -> type[ModelSpec]:
    """From the folder's ``model_index.json``: Wan 2.2 TI2V-5B (``expand_timesteps``), Wan 2.2 I2V
    A14B (a ``WanImageToVideoPipeline`` with two experts), Wan 2.2 T2V A14B (two experts), else Wan 2.1.

    Raises:
        ValueError: ``ti2v_first_frame`` set for a folder that is not TI2V-5B.
    """
    from pathlib import Path

    from simpletuner.models.spec import read_model_index
    from simpletuner.models.wan import read_boundary_ratio
    from simpletuner.models.wan22_ti2v import expands_timesteps

    root = Path(config.pretrained_model_name_or_path).expanduser()
    index = read_model_index(root) if root.is_dir() else None
    if expands_timesteps(index):
        return _spec_class("Wan22TI2VSpec")
    if config.ti2v_first_frame:
        raise ValueError(
            f"ti2v_first_frame is set but {config.pretrained_model_name_or_path} is not a Wan 2.2 TI2V-5B folder "
            "(model_index.json without expand_timesteps: true): remove ti2v_first_frame, or point "
            "pretrained_model_name_or_path at a Wan2.2-TI2V-5B-Diffusers folder"
        )
    i2v = (index or {}).get("_class_name") == "WanImageToVideoPipeline"
    if read_boundary_ratio(config.pretrained_model_name_or_path) is None:
        if i2v:
            raise ValueError(
                f"{root / 'model_index.json'} is a one-transformer WanImageToVideoPipeline (Wan 2.1 I2V, with a CLIP "
                "image encoder), which is not supported: use a Wan 2.2 I2V A14B folder (transformer and "
                "transformer_2), Wan 2.2 TI2V-5B, or a text-to-video Wan folder"
            )
        return _spec_class("WanSpec")
    return _spec_class("Wan22I2VSpec" if i2v else "Wan22Spec")


def _qwen_image_variant(config: "TrainingConfig") -> type[ModelSpec]:
    """From the folder's ``model_index.json``: Qwen-Image-Edit (``QwenImageEditPipeline``), else Qwen-Image.

    Raises:
        ValueError: a ``QwenImageEditPlusPipeline`` folder (Qwen-Image-Edit-2509, several source images).
    """
    from pathlib import Path

    from simpletuner.models.spec import read_model_index

    root = Path(config.pretrained_model_name_or_path).expanduser()
    name = ((read_model_index(root) if root.is_dir() else None) or {}).get("_class_name")
    if name == "QwenImageEditPlusPipeline":
        raise ValueError(
            f"{root / 'model_index.json'} is a QwenImageEditPlusPipeline (Qwen-Image-Edit-2509, edits from several "
            "source images), which is not supported: its prompt template and image handling differ from "
            "Qwen-Image-Edit's. Point pretrained_model_name_or_path at a Qwen-Image-Edit folder "
            "(QwenImageEditPipeline, one source image per edit) or a Qwen-Image folder"
        )
    return _spec_class("QwenImageEditSpec" if name == "QwenImageEditPipeline" else "QwenImageSpec")


def _flux_variant(config: "TrainingConfig") -> type[ModelSpec]:
    """From the folder's ``model_index.json``: Flux.1 Kontext (``FluxKontextPipeline``), else Flux.1; with
    ``controlnet``, Flux.1 with a ControlNet.

    Raises:
        ValueError: ``controlnet`` with a Kontext folder.
    """
    from pathlib import Path

    from simpletuner.models.spec import read_model_index

    root = Path(config.pretrained_model_name_or_path).expanduser()
    name = ((read_model_index(root) if root.is_dir() else None) or {}).get("_class_name")
    if config.controlnet:
        if name == "FluxKontextPipeline":
            raise ValueError(
                f"controlnet: {root / 'model_index.json'} is a FluxKontextPipeline (an edit model), for which no "
                "ControlNet trains here: point pretrained_model_name_or_path at a Flux.1 folder, or remove controlnet"
            )
        return _spec_class("FluxControlNetSpec")
    return _spec_class("FluxKontextSpec" if name == "FluxKontextPipeline" else "FluxSpec")


def _sdxl_variant(config: "TrainingConfig") -> type[ModelSpec]:
    """SDXL, or with ``controlnet`` SDXL with a ControlNet."""
    return _spec_class("StableDiffusionXLControlNetSpec" if config.controlnet else "StableDiffusionXLSpec")


#: Families with variants: family name -> the function choosing the class for a config's folder.
FAMILY_VARIANTS: dict[str, Callable[["TrainingConfig"], type[ModelSpec]]] = {
    "wan": _wan_variant,
    "qwen_image": _qwen_image_variant,
    "flux": _flux_variant,
    "sdxl": _sdxl_variant,
}


def get_model_spec(config: "TrainingConfig") -> ModelSpec:
    """The ModelSpec for ``config.model_family`` (and the folder: a Wan 2.2 folder gets the two-expert spec)."""
    family = config.model_family
    if family not in MODEL_FAMILIES:
        raise ValueError(f"model_family {family!r} is not one of {', '.join(sorted(MODEL_FAMILIES))}")
    variant = FAMILY_VARIANTS.get(family)
    cls = variant(config) if variant is not None else MODEL_FAMILIES[family]
    return cls(config)


__all__ = [
    "MODEL_FAMILIES",
    "FluxControlNetSpec",
    "FluxKontextSpec",
    "FluxSpec",
    "ModelSpec",
    "QwenImageEditSpec",
    "QwenImageSpec",
    "StableDiffusion3Spec",
    "StableDiffusionSpec",
    "StableDiffusionXLControlNetSpec",
    "StableDiffusionXLSpec",
    "Wan22I2VSpec",
    "Wan22Spec",
    "Wan22TI2VSpec",
    "WanSpec",
    "get_model_spec",
]
