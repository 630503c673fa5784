"""What a run's pipeline components weigh, read from their weight files' headers (no model class imported),
and the validation models the trainer keeps on the GPU: the pre-flight's host figures and the estimate's extras.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.models.spec import ComponentLocation

#: The non-variant safetensors weights ``from_pretrained(subfolder=..., use_safetensors=True)`` reads, in the
#: order each library looks for them (diffusers: an index first; transformers: the single file first).
_WEIGHT_FILES = {
    "diffusers": ("diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.safetensors"),
    "transformers": ("model.safetensors", "model.safetensors.index.json"),
}


def component_bytes(model_root: Path, component: str, dtype) -> int | None:
    """Bytes of one pipeline component's weights at ``dtype``; None when unknown (not in ``model_index.json``).

    Read from the headers of the safetensors files the loader would read (:data:`_WEIGHT_FILES`): every
    stored tensor's element count times ``dtype``'s item size, with no model class imported. Unlike the
    meta build it replaces, non-persistent buffers (not in the file: position ids, rotary tables) are not
    counted, and persistent buffers count at ``dtype``. A component without such files (pickle weights
    only, configs only) or with an unreadable header falls back to :func:`_meta_module_bytes`.
    """
    from simpletuner.models.spec import read_model_index

    try:
        library, class_name = (read_model_index(model_root) or {})[component]
    except (OSError, KeyError, ValueError, TypeError):
        return None
    return _folder_bytes(model_root, component, library, class_name, dtype)


def vae_bytes(location: ComponentLocation, dtype) -> int | None:
    """Bytes of the run's VAE weights at ``dtype``, wherever it loads from (``spec.vae_location()``: the model
    folder's ``vae/`` or a separate VAE folder, whose ``config.json`` names its class); None when unknown (a hub id,
    no readable config)."""
    folder = location.local_folder
    if folder is None or not folder.is_dir():
        return None
    if not location.is_separate:
        return component_bytes(Path(location.path).expanduser(), "vae", dtype)
    try:
        class_name = json.loads((folder / "config.json").read_text(encoding="utf-8"))["_class_name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return _folder_bytes(Path(location.path).expanduser(), location.subfolder, "diffusers", class_name, dtype)


def _folder_bytes(root: Path, subfolder: str | None, library: Any, class_name: Any, dtype) -> int | None:
    """:func:`component_bytes` of the component in ``root / subfolder`` (``root`` itself when None), of the class
    ``library.class_name``."""
    names = _WEIGHT_FILES.get(library) if isinstance(library, str) else None
    if names is None:
        return None
    folder = root / subfolder if subfolder else root
    found = next((folder / n for n in names if (folder / n).is_file()), None)
    numel = _stored_numel(found) if found is not None else None
    if numel is None:
        return _meta_module_bytes(root, subfolder, library, class_name, dtype)
    return numel * dtype.itemsize


def _stored_numel(weights: Path) -> int | None:
    """Elements of every tensor in a safetensors file, or in the files a ``*.safetensors.index.json`` maps;
    None when a header or the index cannot be read."""
    from simpletuner.caching.integrity import BadShard, read_header

    try:
        if weights.name.endswith(".index.json"):
            index = json.loads(weights.read_text(encoding="utf-8"))
            files = sorted({weights.parent / name for name in index["weight_map"].values()})
        else:
            files = [weights]
        return sum(math.prod(t["shape"]) for f in files for t in read_header(f).tensors.values())
    except (OSError, BadShard, ValueError, KeyError, TypeError, AttributeError):
        return None


def _meta_module_bytes(root: Path, subfolder: str | None, library: Any, class_name: Any, dtype) -> int | None:
    """Bytes of one component (in ``root / subfolder``, of the class ``library.class_name``) built on ``meta`` from
    its config (parameters at ``dtype``, buffers at their own); None when unknown. Imports the component's class:
    the fallback of :func:`component_bytes`."""
    import torch
    import transformers

    from simpletuner.models.spec import resolve_component_class  # diffusers: load on use

    try:
        resolved = resolve_component_class(library, class_name, "model")
    except (OSError, KeyError, ValueError, TypeError):
        return None
    cls: Any = resolved  # a ModelMixin / PreTrainedModel subclass, checked by resolve_component_class
    with torch.device("meta"):
        if library == "diffusers":
            model = cls.from_config(cls.load_config(str(root), subfolder=subfolder))
        else:
            model = cls(transformers.AutoConfig.from_pretrained(str(root / subfolder if subfolder else root)))
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize + sum(b.nbytes for b in model.buffers())


def validation_model_bytes(config: "TrainingConfig") -> int | None:
    """The VAE (fp32) and text encoder (autocast dtype) the trainer keeps on the GPU for validation
    images; 0 without validation prompts (they are released after caching), None when unknown. With
    ``train_text_encoder`` validation samples with the encoders being trained, counted in the model's weights."""
    import torch

    from simpletuner.models.spec import vae_location

    if not config.validation_prompt_list:
        return 0
    root = Path(config.pretrained_model_name_or_path).expanduser()
    dtype = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[config.mixed_precision]
    vae = vae_bytes(vae_location(config), torch.float32)
    text = 0 if config.train_text_encoder else component_bytes(root, "text_encoder", dtype)
    return None if vae is None or text is None else vae + text
