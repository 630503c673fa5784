"""LyCORIS adapters (LoCon, LoHa, LoKr) on the frozen denoiser, saved in LyCORIS' own format.

The network is built module by module over the layers the family's LoRA targets name (peft's rule: a
name equal to a target or ending in ``.<target>``), or those ``lycoris.apply_preset`` names
(:func:`plan_preset`); not through ``create_lycoris`` / ``apply_preset``, whose target lists are class
attributes shared by every network in the process. Modules run in bypass mode by default
(``y = layer(x) + adapter(x)``). The network is the denoiser's submodule ``lycoris``, so the optimizer,
DDP and checkpoints see its parameters; files use LyCORIS' key names (``create_lycoris_from_weights``).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

import torch
from torch import nn

from simpletuner.file_modes import ordinary_permissions

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.configuration.sections import LycorisModuleOptions, LycorisPreset

#: The network's name as a submodule of the denoiser.
SUBMODULE = "lycoris"
#: LyCORIS' own prefix of module names in files (``LycorisNetwork.LORA_PREFIX``'s default).
PREFIX = "lycoris"
_ALGO_OF_CLASS = {"LoConModule": "locon", "LohaModule": "loha", "LokrModule": "lokr"}


def _lycoris():
    try:
        import lycoris
    except ImportError as exc:
        raise ValueError(
            "lora_type 'lycoris' needs the LyCORIS library: pip install -e \".[lycoris]\" in the simpletuner checkout "
            "(or pip install lycoris-lora) "
            "(or use lora_type 'standard')"
        ) from exc
    return lycoris


def match_targets(denoiser: nn.Module, targets: list[str]) -> dict[str, nn.Module]:
    """The layers ``targets`` name, by module path: a name equal to a target or ending in ``.<target>``."""
    found = {}
    for name, module in denoiser.named_modules():
        if name and any(name == t or name.endswith("." + t) for t in targets):
            found[name] = module
    return found


def lora_name(module_path: str) -> str:
    """LyCORIS' name of the adapter on ``module_path`` (its key prefix in files)."""
    return f"{PREFIX}_{module_path}".replace(".", "_")


class PlannedLayer(NamedTuple):
    """One layer to adapt and the settings its preset entry gives (empty: the network's own)."""

    layer: nn.Module
    settings: Mapping[str, Any]


_SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: Class-name endings that make a module a likely `target_module` (listed when a preset matches nothing).
_CANDIDATE_ENDINGS = ("Attention", "FeedForward", "MLP", "Block", "Block2D", "Block3D", "Layer")


def _is_wide_conv(layer: nn.Module) -> bool:
    return isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and layer.kernel_size[0] != 1


def candidate_classes(denoiser: nn.Module) -> list[str]:
    """The denoiser's module classes a preset most likely means (attention, feed-forward, blocks), sorted."""
    names = {type(m).__name__ for m in denoiser.modules()}
    return sorted(n for n in names if n.endswith(_CANDIDATE_ENDINGS))


def plan_preset(denoiser: nn.Module, preset: "LycorisPreset") -> dict[str, PlannedLayer]:
    """The layers ``preset`` adapts, by module path, with their settings, read as LyCORIS' ``apply_preset``
    reads a preset: each Linear / Conv inside a ``target_module`` / ``module_algo_map`` class (the innermost
    mapped class wins) and each layer a ``target_name`` / ``name_algo_map`` entry matches; ``exclude_name``
    paths are skipped, the first entry to reach a layer decides its settings, and a Conv wider than 1x1
    needs ``enable_conv`` (or a ``dim`` in its settings).

    Raises:
        ValueError: a class or name of the preset matches nothing (each named, with the denoiser's
            candidate classes), or nothing it matches can be adapted.
    """
    planner = _PresetPlanner(preset)
    planner.visit(denoiser)
    planner.check(denoiser)
    return planner.plan


class _PresetPlanner:
    """One preset's walk over a denoiser: the layers it adapts, and the classes and names it reached."""

    def __init__(self, preset: "LycorisPreset"):
        self.preset = preset
        self.class_maps = preset.module_algo_map
        self.target_classes = set(preset.target_module) | set(self.class_maps)
        self.name_patterns = list(dict.fromkeys([*preset.target_name, *preset.name_algo_map]))
        self.plan: dict[str, PlannedLayer] = {}
        self.seen_classes: set[str] = set()
        self.seen_names: set[str] = set()

    def _matches(self, pattern: str, path: str) -> bool:
        return fnmatch.fnmatch(path, pattern) if self.preset.use_fnmatch else re.match(pattern, path) is not None

    def _excluded(self, path: str) -> bool:
        return bool(path) and any(path == p or self._matches(p, path) for p in self.preset.exclude_name)

    def _add(self, path: str, layer: nn.Module, settings: dict[str, Any]) -> None:
        """Plan ``layer`` unless an earlier entry did, or LyCORIS cannot adapt it with ``settings``."""
        if path in self.plan or not isinstance(layer, _SUPPORTED):
            return
        if not _is_wide_conv(layer) or self.preset.enable_conv or "dim" in settings:
            self.plan[path] = PlannedLayer(layer, settings)

    def visit(self, denoiser: nn.Module) -> None:
        for path, module in denoiser.named_modules():
            if not path or self._excluded(path):
                continue
            cls = type(module).__name__
            hits = [p for p in self.name_patterns if path == p or self._matches(p, path)]
            if cls in self.target_classes and not hits:
                self.seen_classes.add(cls)
                self._walk(path, module, _settings_of(self.class_maps.get(cls)))
            elif hits:
                self.seen_names.update(hits)
                by_name = next((self.preset.name_algo_map[p] for p in hits if p in self.preset.name_algo_map), None)
                self._add(path, module, _settings_of(by_name if by_name is not None else self.class_maps.get(cls)))

    def _walk(self, root_path: str, root: nn.Module, settings: dict[str, Any]) -> None:
        """The layers inside a targeted module ``root``; a mapped class inside passes its own settings on."""
        for sub_path, sub in root.named_modules():
            path = f"{root_path}.{sub_path}" if root_path and sub_path else (root_path or sub_path)
            if self._excluded(path):
                continue
            cls = type(sub).__name__
            if sub is not root and cls in self.class_maps:
                self._walk(path, sub, _settings_of(self.class_maps[cls]))  # its own layers take its own settings
                continue
            self._add(path, sub, settings)

    def check(self, denoiser: nn.Module) -> None:
        """Refuse a preset with a class or name that matched nothing, or one that planned no layer."""
        unmatched_classes = sorted(self.target_classes - self.seen_classes)
        unmatched_names = [p for p in self.name_patterns if p not in self.seen_names]
        model = type(denoiser).__name__
        if unmatched_classes or unmatched_names:
            what = []
            if unmatched_classes:
                what.append(f"module classes {unmatched_classes}")
            if unmatched_names:
                what.append(f"layer names {unmatched_names}")
            raise ValueError(
                f"lycoris.apply_preset: {' and '.join(what)} match nothing in the {model}. Its attention, "
                f"feed-forward and block classes are {candidate_classes(denoiser)}: name those in target_module "
                "(or module paths from the model in target_name)"
            )
        if not self.plan:
            raise ValueError(
                f"lycoris.apply_preset matches modules of the {model}, but none of their layers is a Linear or Conv "
                "layer LyCORIS can adapt: target the classes that hold them (e.g. Attention, FeedForward)"
            )


def _settings_of(entry: "LycorisModuleOptions | None") -> dict[str, Any]:
    return {} if entry is None else entry.model_dump(exclude_none=True)


def _targets_plan(denoiser: nn.Module, targets: list[str]) -> dict[str, PlannedLayer]:
    layers = match_targets(denoiser, targets)
    unsupported = sorted(n for n, m in layers.items() if not isinstance(m, _SUPPORTED))
    if unsupported:
        raise ValueError(
            f"lora_target_modules match layers LyCORIS cannot adapt ({unsupported[:3]}...): "
            "name Linear or Conv layers (e.g. to_q, to_k, to_v, to_out.0)"
        )
    if not layers:
        raise ValueError(
            f"lora_target_modules {targets} match no module of the {type(denoiser).__name__}; "
            "use names of its Linear/Conv layers (e.g. to_q, to_k, to_v, to_out.0)"
        )
    return {path: PlannedLayer(layer, {}) for path, layer in layers.items()}


def apply_lycoris(denoiser: nn.Module, targets: list[str], config: "TrainingConfig") -> nn.Module:
    """Add a trainable fp32 LyCORIS network (``config.lycoris.algo``, rank ``lora_rank``, alpha
    ``lora_alpha``) on the frozen ``denoiser``'s ``targets`` (or the layers ``lycoris.apply_preset``
    names, with their per-class settings); returns the network (also the denoiser's submodule ``lycoris``).

    Conv layers wider than 1x1 take ``lycoris.conv_dim`` / ``conv_alpha`` when set; a preset entry's
    ``dim`` / ``alpha`` / ``algo`` / ``factor`` / ``full_matrix`` override the network's for its layers.

    Raises:
        ValueError: LyCORIS is not installed, an option it does not take, or no layer matches (with a
            preset: any of its classes or names that matches nothing).
    """
    _lycoris()
    from lycoris.wrapper import network_module_dict

    options = config.lycoris
    if config.lora_use_dora:
        raise ValueError("lora_use_dora is for lora_type 'standard' (peft DoRA); set it false with lora_type 'lycoris'")
    if hasattr(denoiser, SUBMODULE):
        raise ValueError(
            f"{type(denoiser).__name__} already has a LyCORIS network (or a submodule named {SUBMODULE!r})"
        )
    if options.apply_preset is not None:
        plan = plan_preset(denoiser, options.apply_preset)
    else:
        plan = _targets_plan(denoiser, targets)
    rank, alpha = config.lora_rank, config.effective_lora_alpha
    conv_rank = options.conv_dim if options.conv_dim is not None else rank
    conv_alpha = options.conv_alpha if options.conv_alpha is not None else alpha
    network = _empty_network(denoiser)
    algos = set()
    for path, (layer, settings) in plan.items():
        algo = settings.get("algo", options.algo)
        algos.add(algo)
        wide = _is_wide_conv(layer)
        extra = {}
        if algo == "lokr":
            extra = {
                "factor": settings.get("factor", options.factor),
                "full_matrix": settings.get("full_matrix", options.full_matrix),
            }
        network.loras.append(
            network_module_dict[algo](
                lora_name(path),
                layer,
                options.multiplier,
                settings.get("dim", conv_rank if wide else rank),
                settings.get("alpha", conv_alpha if wide else alpha),
                config.lora_dropout,
                0.0,
                0.0,
                bypass_mode=options.bypass_mode,
                **extra,
            )
        )
    # The file's metadata (adapter_metadata): the algo, and LoKr's network-wide settings.
    network.simpletuner_options = {"algo": next(iter(algos)) if len(algos) == 1 else "mixed"}
    if algos == {"lokr"}:
        network.simpletuner_options.update(factor=str(options.factor), full_matrix=str(options.full_matrix))
    return _attach(denoiser, network)


def _empty_network(denoiser: nn.Module):
    from lycoris.wrapper import LycorisNetwork

    network = LycorisNetwork(denoiser, init_only=True)  # a container: no module walk, no class state
    network.simpletuner_options = {}
    return network


def _attach(denoiser: nn.Module, network) -> nn.Module:
    network.apply_to()  # hooks each layer's forward and registers the modules on the network
    network.requires_grad_(True)
    for p in network.parameters():
        p.data = p.data.float()  # adapters train in fp32 whatever the base precision
    denoiser.add_module(SUBMODULE, network)
    return network


def lycoris_network(denoiser: nn.Module):
    """The LyCORIS network on ``denoiser`` (its ``lycoris`` submodule).

    Raises:
        ValueError: the denoiser carries none.
    """
    network = getattr(denoiser, SUBMODULE, None)
    if network is None or not hasattr(network, "loras"):
        raise ValueError(f"{type(denoiser).__name__} has no LyCORIS network: was it set up with lora_type 'lycoris'?")
    return network


def adapter_metadata(network) -> dict[str, str]:
    """The file metadata describing ``network``: kohya-style ``ss_network_*`` keys (module,
    dim, alpha, args with the algo) as LyCORIS-aware tools read them."""
    first = network.loras[0]
    algo = _ALGO_OF_CLASS.get(type(first).__name__, type(first).__name__)
    rank = int(getattr(first, "lora_dim", 0))
    alpha = float(first.alpha)
    args = {"algo": algo, **{k: v for k, v in network.simpletuner_options.items() if k != "algo"}}
    return {
        "ss_network_module": "lycoris.kohya",
        "ss_network_dim": str(rank),
        "ss_network_alpha": f"{alpha:g}",
        "ss_network_args": json.dumps(args, sort_keys=True),
        "lycoris_algo": algo,
    }


def save_lycoris(
    denoiser: nn.Module, path: str | Path, metadata: "Mapping[str, object] | TrainingConfig | None" = None
) -> Path:
    """Write ``denoiser``'s LyCORIS network to ``path`` (safetensors, LyCORIS key format, fp32).

    The file's metadata names the algo, rank and alpha (``adapter_metadata``). ``metadata``: more
    entries (values written as strings), or the run's TrainingConfig, whose model family and base
    model are recorded. Written to a temporary file and renamed into place.

    Raises:
        ValueError: the denoiser carries no LyCORIS network.
    """
    from safetensors.torch import save_file

    network = lycoris_network(denoiser)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in network.state_dict().items()}
    if metadata is not None and not isinstance(metadata, Mapping):  # a TrainingConfig
        metadata = {
            "simpletuner_model_family": metadata.model_family,
            "simpletuner_base_model": metadata.pretrained_model_name_or_path,
        }
    meta = {**adapter_metadata(network), **{k: str(v) for k, v in (metadata or {}).items()}}
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp), metadata=meta)
    ordinary_permissions(tmp)  # safetensors writes 0600
    os.replace(tmp, path)
    return path


def load_lycoris(denoiser: nn.Module, path: str | Path, multiplier: float = 1.0) -> nn.Module:
    """Restore a LyCORIS file onto a freshly loaded (frozen) base ``denoiser``, through LyCORIS'
    own ``create_lycoris_from_weights``; returns the network (the denoiser's ``lycoris`` submodule).

    Raises:
        ValueError: LyCORIS is not installed, or no module of the file matches the denoiser.
    """
    _lycoris()
    from lycoris import create_lycoris_from_weights
    from safetensors.torch import load_file

    weights = load_file(str(path))
    network, _ = create_lycoris_from_weights(multiplier, str(path), denoiser, weights_sd=weights)
    expected = {key.split(".")[0] for key in weights}
    loaded = {m.lora_name for m in network.loras}
    if not loaded or loaded != expected:
        missing = sorted(expected - loaded)
        raise ValueError(
            f"{path}: {len(missing)} of {len(expected)} LyCORIS modules match no layer of the "
            f"{type(denoiser).__name__} (e.g. {missing[:2]}): is it the base model the adapter was trained on?"
        )
    for module in network.loras:
        if module.module_type == "linear":
            module.bypass_mode = True  # compute as in training (outputs match it exactly)
    network.simpletuner_options = {}
    _attach(denoiser, network)
    network.requires_grad_(False)
    return network
