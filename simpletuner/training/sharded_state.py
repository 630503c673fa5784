"""FSDP2 through Accelerate: what a sharded run may be, its checkpoint shards, and the whole
weights for the final save.

:func:`enable_fsdp` makes an FSDP launch train with FSDP2, also on CPU (gloo), where Accelerate would fall
back to DDP. A sharded checkpoint keeps the model and optimizer state in ``shards/``
(``torch.distributed.checkpoint``, one file per rank); its ``trainable.safetensors`` and ``optimizer.pt``
are placeholders naming that folder. A resume needs the same number of processes. The reasoning:
documentation/DISTRIBUTED.md, "Sharding a full fine-tune: FSDP2".
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

logger = logging.getLogger(__name__)

#: The folder of a sharded checkpoint holding the model and optimizer state, one file per rank.
SHARDS = "shards"
#: What the placeholder ``trainable.safetensors`` / ``optimizer.pt`` of a sharded checkpoint say.
PLACEHOLDER = {"sharded_state": SHARDS}

_LAUNCH_HELP = (
    "launch a full fine-tune (training_type: full) with config/accelerate_config_gh200_fsdp.yaml, or drop FSDP "
    "(config/accelerate_config_gh200.yaml) for this run"
)


def fsdp_requested(env=os.environ) -> bool:
    """Whether the launcher asked for FSDP (``distributed_type: FSDP`` in the accelerate config)."""
    return env.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def refuse_deepspeed(env=os.environ) -> None:
    """Raise ValueError when the launcher asked for DeepSpeed: this trainer drives accumulation, gradient
    sync and checkpoints itself, which a DeepSpeed engine takes over; it is not supported (nor tested)."""
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true"):
        raise ValueError(
            "the accelerate config asks for DeepSpeed, which this trainer does not support: its engine owns "
            "accumulation, gradient sync and checkpoints, which the trainer drives itself. Shard a full fine-tune "
            "with FSDP2 instead: `accelerate launch --config_file config/accelerate_config_gh200_fsdp.yaml ...`"
        )


def is_sharded(accelerator) -> bool:
    """Whether ``accelerator`` shards the model with FSDP."""
    from accelerate.utils import DistributedType

    return getattr(accelerator, "distributed_type", None) == DistributedType.FSDP


def enable_fsdp(accelerator, env=os.environ) -> None:
    """Make sure an FSDP launch trains with FSDP2: on CPU, switch Accelerate's ``MULTI_CPU`` state to
    FSDP (see the module doc). Raises ValueError for FSDP version 1 (this trainer saves FSDP2 shards)."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    version = env.get("FSDP_VERSION", "1")
    if version != "2":
        raise ValueError(
            f"the accelerate config asks for FSDP version {version}: this trainer supports FSDP2 only. Set "
            "`fsdp_version: 2` under fsdp_config in the accelerate config (as config/accelerate_config_gh200_fsdp.yaml)"
        )
    state = accelerator.state
    if state.distributed_type == DistributedType.MULTI_CPU:
        plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables, as Accelerate builds it
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)
        state.fsdp_plugin = plugin
        state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState does it
        logger.info("FSDP2 on CPU (gloo): Accelerate sets FSDP up only on GPUs; switched its state to FSDP")
    if not is_sharded(accelerator):
        raise ValueError(
            f"the launcher asked for FSDP but Accelerate set up {state.distributed_type}: launch with several "
            "processes (`accelerate launch --config_file config/accelerate_config_gh200_fsdp.yaml ...`)"
        )


def fsdp_problems(config) -> list[str]:
    """What in ``config`` a sharded run cannot do, one line each with the fix (empty: it can run)."""
    problems = []
    if config.training_type != "full":
        problems.append(
            f"training_type {config.training_type!r}: FSDP here shards a full fine-tune; a LoRA / LyCORIS run "
            "keeps its frozen base whole on every GPU, so launch it without FSDP "
            "(config/accelerate_config_gh200.yaml); or set training_type: full"
        )
    if config.use_ema:
        problems.append(
            "use_ema: the EMA is kept whole on rank 0 and cannot average sharded weights; set use_ema false"
        )
    if config.validation_prompt_list:
        problems.append(
            "validation prompts: validation renders on rank 0 alone, and a sharded model needs every rank for a "
            "forward pass; remove validation_prompt (and validation_prompt_list) or launch without FSDP"
        )
    if config.low_vram:
        problems.append("low_vram: its offloading does not combine with FSDP's sharding; set low_vram: false")
    if str(config.optimizer).startswith(("bnb-", "optimi-")):
        problems.append(
            f"optimizer {config.optimizer!r}: its state is kept per whole parameter (bitsandbytes' blockwise 8-bit "
            "state, optimi's fused steps) and is not built for sharded DTensor parameters (SimpleTuner falls back "
            "from these under FSDP2 too); use adamw, adamw_bf16 or prodigy with FSDP"
        )
    return problems


def check_fsdp_run(config, accelerator) -> None:
    """Raise ValueError (every problem at once) when ``accelerator`` shards and ``config`` asks for
    something a sharded run cannot do. Called before anything loads."""
    if not is_sharded(accelerator):
        return
    problems = fsdp_problems(config)
    if problems:
        raise ValueError(
            "this run is launched with FSDP, which cannot train it:\n  - "
            + "\n  - ".join(problems)
            + f"\nTo fix: change the config as said, or {_LAUNCH_HELP}."
        )


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as an ordinary tensor: a DTensor (an FSDP gradient norm) is reduced to its full value."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps the torch one


def write_placeholders(folder: Path) -> None:
    """The ``trainable.safetensors`` and ``optimizer.pt`` of a sharded checkpoint (rank 0)."""
    save_file({}, folder / "trainable.safetensors", metadata=PLACEHOLDER)
    torch.save(PLACEHOLDER, folder / "optimizer.pt")


def save_shards(folder: Path, model: nn.Module, optimizer) -> None:
    """Every rank writes its slice of the model and optimizer state to ``folder/shards`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, _inner(optimizer))
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder / SHARDS))


def load_shards(folder: Path, model: nn.Module, optimizer) -> None:
    """Put the model and optimizer state of ``folder/shards`` back, each rank its slice (collective).
    A missing or extra key is an error naming it (``torch.distributed.checkpoint``'s own check)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    inner = _inner(optimizer)
    model_state, optim_state = get_state_dict(model, inner)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(folder / SHARDS))
    set_state_dict(model, inner, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_state(model: nn.Module) -> dict[str, Any]:
    """The whole state dict of a sharded ``model`` on CPU, on rank 0 (empty elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def unsharded_copy(model: nn.Module) -> nn.Module | None:
    """Rank 0: a plain (unsharded) module of ``model``'s class and config holding its gathered weights,
    for ``save_pretrained``; None on the other ranks. Collective: every rank must call it."""
    from torch.distributed.fsdp import FSDPModule

    state = full_state(model)
    if not state:
        return None
    # fully_shard made a subclass; the class below it is the model's own (a diffusers model: from_config)
    cls: Any = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        copy = cls.from_config(model.config)
    copy.load_state_dict(state, assign=True, strict=True)
    return copy.eval()


def load_checkpoint_weights(checkpoint: Path, model: nn.Module) -> nn.Module:
    """One process, no ``torch.distributed``: put the trained weights of the sharded checkpoint
    folder ``checkpoint`` into a plain ``model`` of the same class (e.g. the base model's denoiser);
    returns it. Then ``model.save_pretrained(folder)`` makes a single diffusers folder of it."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, checkpoint_id=str(Path(checkpoint) / SHARDS), no_dist=True)  # only these keys
    model.load_state_dict(state)
    return model
