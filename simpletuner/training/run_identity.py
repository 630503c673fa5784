"""A run's identity: the settings a checkpoint records and a resume compares, so a checkpoint of
another model, adapter, batch size or seed is refused (naming every difference and the fix)
instead of continued with weights or optimizer state that do not fit. ``trainer_state.json`` keeps
it under ``identity``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson
import torch

from simpletuner.hub import VAE_KEY, hub_cache_dir, snapshot_of
from simpletuner.training.checkpoint_verify import ResumeRefused


def run_identity(config, spec, denoiser_config: str | None, hub_model: str | None = None) -> dict[str, Any]:
    """The identity of a run of ``config`` with the ModelSpec ``spec``; ``denoiser_config`` is the
    :func:`denoiser_fingerprint` of the loaded denoiser (None before it is loaded); ``hub_model``: the
    ``org/name@commit`` a hub id resolved to (None for a local folder, and then not recorded); ``hub_vae``, the same
    for a separate VAE loaded from a Hub cache snapshot (:func:`hub_vae`)."""
    is_lora = config.training_type == "lora"
    hub = {"hub_model": hub_model} if hub_model is not None else {}
    vae = hub_vae(spec)
    if vae is not None:
        hub["hub_vae"] = vae
    controlnet = snapshot_of(config.controlnet_model_name_or_path) if config.controlnet_model_name_or_path else None
    if controlnet is not None:
        hub["hub_controlnet"] = f"{controlnet[0]}@{controlnet[1]}"
    # recorded only when on: checkpoints from before the key stay resumable
    text_encoders = {"train_text_encoder": True} if config.train_text_encoder else {}
    controlled = {"controlnet": True} if config.controlnet else {}
    return {
        **hub,
        **text_encoders,
        **controlled,
        "model_family": config.model_family,
        "training_type": config.training_type,
        "lora_rank": config.lora_rank if is_lora else None,
        "lora_targets": spec.lora_targets if is_lora else None,
        "train_batch_size": config.train_batch_size,
        "denoiser_config": denoiser_config,
        "lora_type": config.lora_type if is_lora else None,
        "lycoris_algo": config.lycoris.algo if is_lora and config.lora_type == "lycoris" else None,
        "base_model_precision": config.base_model_precision,
        "train_stages": config.train_stages,
        "seed": config.seed,  # another seed is another run: its checkpoints are refused, not continued
    }


def hub_vae(spec) -> str | None:
    """``org/name@commit`` of the separate VAE (``pretrained_vae_model_name_or_path``) where it loads from a Hub
    cache snapshot folder (a hub id resolved by the entry point, or that folder named itself); None otherwise."""
    location = spec.vae_location()
    found = snapshot_of(location.path) if location.is_separate else None
    return None if found is None else f"{found[0]}@{found[1]}"


def denoiser_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the denoiser's architecture config, kept in the run identity: a checkpoint of
    another model is refused."""
    config = {k: v for k, v in dict(getattr(model, "config", {})).items() if not k.startswith("_")}
    return hashlib.sha256(orjson.dumps(config, option=orjson.OPT_SORT_KEYS, default=str)).hexdigest()[:16]


def describe_run(state: dict[str, Any]) -> str:
    """``run 3f2a9c1b, seed 123`` for a checkpoint's state (what it does not hold is left out)."""
    identity = state.get("identity") or {}
    parts = [f"run {state['run_id']}"] if state.get("run_id") else []
    if identity.get("seed") is not None:
        parts.append(f"seed {identity['seed']}")
    return ", ".join(parts)


def identity_differences(state: dict[str, Any], identity: dict[str, Any]) -> list[str]:
    """How the run identity a checkpoint stores differs from ``identity`` (only its keys are compared)."""
    saved = state.get("identity", {})
    return [
        f"{key}: checkpoint has {saved.get(key)!r}, config has {value!r}"
        for key, value in identity.items()
        if saved.get(key) != value
    ]


def check_compatible(state: dict[str, Any], identity: dict[str, Any], world_size: int, path: Path) -> None:
    """Raise ResumeRefused (a ValueError) naming every way the checkpoint does not fit this run, and the fix."""
    problems = identity_differences(state, identity)
    saved_world = state.get("world_size")
    if saved_world != world_size:
        problems.append(f"world size: checkpoint was written by {saved_world} process(es), this run has {world_size}")
    if problems:
        fixes = []
        if saved_world != world_size and isinstance(saved_world, int):
            fixes.append(
                f"launch with the checkpoint's {saved_world} process(es) "
                f"(`accelerate launch --num_processes {saved_world} ...`) to continue it"
            )
        saved_hub = state.get("identity", {}).get("hub_model")
        if isinstance(saved_hub, str) and "@" in saved_hub and saved_hub != identity.get("hub_model"):
            fixes.append(
                f"set `revision` to {saved_hub.rsplit('@', 1)[1]} to load the Hub snapshot the checkpoint used"
            )
        saved_vae = state.get("identity", {}).get("hub_vae")
        if isinstance(saved_vae, str) and "@" in saved_vae and saved_vae != identity.get("hub_vae"):
            repo, commit = saved_vae.rsplit("@", 1)
            folder = hub_cache_dir() / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
            fixes.append(
                f"set `{VAE_KEY}` to {folder} (the Hub cache's snapshot of {repo} at that commit, while it holds it) "
                "to load the VAE the checkpoint used"
            )
        if len(problems) > (saved_world != world_size):
            fixes.append("put the settings above back to the checkpoint's values to continue it")
        fixes += [
            f"set a new `output_dir` to start a new run beside it ({path} stays as it is)",
            "or set `resume_from_checkpoint: null` and pass `--overwrite` to train from scratch "
            "(it replaces the run in `output_dir`)",
        ]
        run = describe_run(state)
        raise ResumeRefused(
            f"cannot resume from {path}{f' ({run})' if run else ''}: it does not fit this run:\n  - "
            + "\n  - ".join(problems)
            + "\nTo fix: "
            + "; ".join(fixes)
            + "."
        )
