"""The config ``simpletuner estimate`` judges: the file with ``--set``, and the launcher settings a training run
would take from the environment (the precision above all).

Read and validated with the configuration layer alone, so a refused config answers before torch, the hardware
probe or a model library is imported (:mod:`simpletuner.cli.estimate_run` imports those only after this).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import orjson

from simpletuner.configuration import ConfigError, LoadedConfig, load_config
from simpletuner.configuration.launcher import resolve_launcher_settings
from simpletuner.configuration.loader import read_raw_config


@dataclass(frozen=True)
class EstimatedConfig:
    """The config as an estimate sees it, and the line saying which precision it is estimated in, and why."""

    loaded: LoadedConfig
    precision_line: str


def read_estimated_config(config_path: str, overrides: Sequence[str]) -> EstimatedConfig:
    """Load ``config_path`` with ``overrides`` and the environment's launcher settings; ConfigError as ``train``
    would raise it."""
    precision_line, launch_overrides = _precision_in_force(config_path, list(overrides))
    loaded = load_config(
        config_path, [*overrides, *launch_overrides, *_hub_configs(config_path, overrides)], check_files=False
    )
    return EstimatedConfig(loaded, precision_line)


def _hub_configs(config_path: str, overrides: Sequence[str]) -> list[str]:
    """A hub id's configs only (no weights) fetched into the Hub cache, and the ``--set`` item that points the
    estimate at that snapshot folder; nothing for a local folder. The same for a separate VAE's hub id (its config
    gives the latents' shape and its size)."""
    from simpletuner.hub import VAE_KEY, HubError, resolve_config_model, resolve_config_vae

    raw = read_raw_config(config_path, list(overrides))
    items, problems = [], []
    for key, resolve in (("pretrained_model_name_or_path", resolve_config_model), (VAE_KEY, resolve_config_vae)):
        try:
            hub = resolve(raw)
        except HubError as exc:
            problems.append(f"{key}: {exc}")
            continue
        if hub is not None:
            items.append(f"{key}={orjson.dumps(str(hub.folder)).decode()}")
    if problems:
        raise ConfigError(problems, config_path)
    return items


def _precision_in_force(config_path: str, overrides: list[str]) -> tuple[str, list[str]]:
    """The precision a training run of this config would use, as ``train`` decides it without a
    launcher (the config, else ACCELERATE_MIXED_PRECISION), a line saying so, and the ``--set``
    items that bring the environment's launcher settings in. A launch line is not known here, so
    a config that leaves the precision to it is estimated as fp32, and the line says how to ask."""
    raw = read_raw_config(config_path, overrides)
    launch = resolve_launcher_settings(raw, os.environ, None, config_source=str(config_path))
    setting = launch.settings.get("mixed_precision")
    if setting is not None:
        return f"precision: {setting.value} ({setting.source})", launch.overrides
    return (
        "precision: no (fp32): the config leaves mixed_precision to the launch, and estimate cannot see a "
        "launch line; a launch asking for bf16 (`accelerate launch --mixed_precision bf16`, or the GH200 "
        "Accelerate config) trains in bf16: estimate that with --set mixed_precision=bf16"
    ), launch.overrides
