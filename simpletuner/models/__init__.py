"""Model families behind the ModelSpec contract, and the tiny model zoo."""

from __future__ import annotations

from typing import TYPE_CHECKING

from simpletuner.models.library_probes import quiet_model_libraries

quiet_model_libraries()  # before any model library loads: no torchao unless a config quantises with it

from simpletuner.models.flux import FluxSpec  # noqa: E402
from simpletuner.models.sd import StableDiffusionSpec
from simpletuner.models.sd3 import StableDiffusion3Spec
from simpletuner.models.sdxl import StableDiffusionXLSpec
from simpletuner.models.spec import ModelSpec
from simpletuner.models.wan import WanSpec

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

#: Family name (the config's ``model_family``) -> its ModelSpec class.
MODEL_FAMILIES: dict[str, type[ModelSpec]] = {
    "sd": StableDiffusionSpec,
    "sdxl": StableDiffusionXLSpec,
    "sd3": StableDiffusion3Spec,
    "flux": FluxSpec,
    "wan": WanSpec,
}


def get_model_spec(config: "TrainingConfig") -> ModelSpec:
    """The ModelSpec for ``config.model_family`` (and the folder: a Wan 2.2 folder gets the two-expert spec)."""
    try:
        cls = MODEL_FAMILIES[config.model_family]
    except KeyError:
        raise ValueError(
            f"model_family {config.model_family!r} is not one of {', '.join(sorted(MODEL_FAMILIES))}"
        ) from None
    return cls.variant_for(config)(config)


__all__ = [
    "MODEL_FAMILIES",
    "FluxSpec",
    "ModelSpec",
    "StableDiffusion3Spec",
    "StableDiffusionSpec",
    "StableDiffusionXLSpec",
    "WanSpec",
    "get_model_spec",
]
