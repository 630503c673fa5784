"""LyCORIS adapters (LoCon, LoHa, LoKr) on the frozen denoiser, saved in LyCORIS' own format.

The network is built module by module over the denoiser's layers named by the family's LoRA
targets (peft's rule: a module whose name is a target or ends with ``.<target>``), not through
``create_lycoris`` / ``LycorisNetwork.apply_preset``, which keep the target lists in class
attributes shared by every network in the process. Each LyCORIS module hooks its layer's forward
(``y = layer(x) + adapter(x)``: bypass mode, which never materialises a weight-sized delta and
runs on quantised layers too), and the network is registered as the denoiser's submodule
``lycoris``: the optimizer, Accelerate/DDP, ``trainable_state`` and checkpoint resume see its
parameters through ``denoiser.parameters()`` like any other.

Files use LyCORIS' key names (``lycoris_<module path with _>.lora_down.weight``, ``.alpha``, ...),
the format ``create_lycoris_from_weights`` and other LyCORIS-aware tools load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch
from torch import nn

from simpletuner.file_modes import ordinary_permissions

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

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


def apply_lycoris(denoiser: nn.Module, targets: list[str], config: "TrainingConfig") -> nn.Module:
    """Add a trainable fp32 LyCORIS network (``config.lycoris.algo``, rank ``lora_rank``, alpha
    ``lora_alpha``) on the frozen ``denoiser``'s ``targets``; returns the network (also the
    denoiser's submodule ``lycoris``).

    Raises:
        ValueError: LyCORIS is not installed, an option it does not take, or no layer matches.
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
    layers = match_targets(denoiser, targets)
    supported = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    unsupported = sorted(n for n, m in layers.items() if not isinstance(m, supported))
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
    extra = {"factor": options.factor, "full_matrix": options.full_matrix} if options.algo == "lokr" else {}
    module_cls = network_module_dict[options.algo]
    network = _empty_network(denoiser)
    for path, layer in layers.items():
        network.loras.append(
            module_cls(
                lora_name(path),
                layer,
                1.0,
                config.lora_rank,
                config.effective_lora_alpha,
                config.lora_dropout,
                0.0,
                0.0,
                bypass_mode=True,
                **extra,
            )
        )
    network.simpletuner_options = {"algo": options.algo, **{k: str(v) for k, v in extra.items()}}
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
    if hasattr(metadata, "model_family"):  # a TrainingConfig
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
