"""Model families behind the ModelSpec contract (tiny random-weight ones to test with: simpletuner.testing.zoo)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from simpletuner.models.library_probes import quiet_model_libraries

quiet_model_libraries()  # before any model library loads: no torchao unless a config quantises with it

from simpletuner.models.flux import FluxSpec  # noqa: E402
from simpletuner.models.qwen_image import QwenImageSpec  # noqa: E402
from simpletuner.models.qwen_image_edit import QwenImageEditSpec  # noqa: E402
from simpletuner.models.sd import StableDiffusionSpec  # noqa: E402
from simpletuner.models.sd3 import StableDiffusion3Spec  # noqa: E402
from simpletuner.models.sdxl import StableDiffusionXLSpec  # noqa: E402
from simpletuner.models.spec import ModelSpec  # noqa: E402
from simpletuner.models.wan import WanSpec, read_boundary_ratio  # noqa: E402
from simpletuner.models.wan22 import Wan22Spec  # noqa: E402
from simpletuner.models.wan22_i2v import Wan22I2VSpec  # noqa: E402
from simpletuner.models.wan22_ti2v import Wan22TI2VSpec, expands_timesteps  # noqa: E402

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

#: Family name (the config's ``model_family``, keyed by each spec's own ``family``; a test keeps it equal to
#: ``simpletuner.configuration.families.FAMILIES``) -> its ModelSpec class (the base of a family with variants).
MODEL_FAMILIES: dict[str, type[ModelSpec]] = {
    spec.family: spec
    for spec in (StableDiffusionSpec, StableDiffusionXLSpec, StableDiffusion3Spec, FluxSpec, WanSpec, QwenImageSpec)
}


def _wan_variant(config: "TrainingConfig") -> type[ModelSpec]:
    """From the folder's ``model_index.json``: Wan 2.2 TI2V-5B (``expand_timesteps``), Wan 2.2 I2V
    A14B (a ``WanImageToVideoPipeline`` with two experts), Wan 2.2 T2V A14B (two experts), else Wan 2.1.

    Raises:
        ValueError: ``ti2v_first_frame`` set for a folder that is not TI2V-5B.
    """
    from pathlib import Path

    from simpletuner.models.spec import read_model_index

    root = Path(config.pretrained_model_name_or_path).expanduser()
    index = read_model_index(root) if root.is_dir() else None
    if expands_timesteps(index):
        return Wan22TI2VSpec
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
        return WanSpec
    return Wan22I2VSpec if i2v else Wan22Spec


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
    return QwenImageEditSpec if name == "QwenImageEditPipeline" else QwenImageSpec


#: Families with variants: family name -> the function choosing the class for a config's folder.
FAMILY_VARIANTS: dict[str, Callable[["TrainingConfig"], type[ModelSpec]]] = {
    "wan": _wan_variant,
    "qwen_image": _qwen_image_variant,
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
    "FluxSpec",
    "ModelSpec",
    "QwenImageEditSpec",
    "QwenImageSpec",
    "StableDiffusion3Spec",
    "StableDiffusionSpec",
    "StableDiffusionXLSpec",
    "Wan22I2VSpec",
    "Wan22Spec",
    "Wan22TI2VSpec",
    "WanSpec",
    "get_model_spec",
]
