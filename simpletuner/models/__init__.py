"""Model families behind the ModelSpec contract, and the tiny model zoo."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from simpletuner.models.library_probes import quiet_model_libraries

quiet_model_libraries()  # before any model library loads: no torchao unless a config quantises with it

from simpletuner.models.flux import FluxSpec  # noqa: E402
from simpletuner.models.sd import StableDiffusionSpec  # noqa: E402
from simpletuner.models.sd3 import StableDiffusion3Spec  # noqa: E402
from simpletuner.models.sdxl import StableDiffusionXLSpec  # noqa: E402
from simpletuner.models.spec import ModelSpec  # noqa: E402
from simpletuner.models.wan import WanSpec, read_boundary_ratio  # noqa: E402
from simpletuner.models.wan22 import Wan22Spec  # noqa: E402

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

#: Family name (the config's ``model_family``; the families are listed in
#: ``simpletuner.configuration.families``) -> its ModelSpec class (the base of a family with variants).
MODEL_FAMILIES: dict[str, type[ModelSpec]] = {
    "sd": StableDiffusionSpec,
    "sdxl": StableDiffusionXLSpec,
    "sd3": StableDiffusion3Spec,
    "flux": FluxSpec,
    "wan": WanSpec,
}


def _wan_variant(config: "TrainingConfig") -> type[ModelSpec]:
    """Wan 2.2 (two experts) for a folder that names a boundary between them, else Wan 2.1."""
    return Wan22Spec if read_boundary_ratio(config.pretrained_model_name_or_path) is not None else WanSpec


#: Families with variants: family name -> the function choosing the class for a config's folder.
FAMILY_VARIANTS: dict[str, Callable[["TrainingConfig"], type[ModelSpec]]] = {"wan": _wan_variant}


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
    "FluxSpec",
    "ModelSpec",
    "StableDiffusion3Spec",
    "StableDiffusionSpec",
    "StableDiffusionXLSpec",
    "Wan22Spec",
    "WanSpec",
    "get_model_spec",
]
