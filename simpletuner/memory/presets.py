"""Hardware presets: named sets of config keys, each with the reason it is chosen.

A preset is one JSON file in ``config/presets/``::

    {"name": "gb10_conservative", "hardware": "GB10 / DGX Spark (128 GB shared LPDDR5X)",
     "gpu": "gb10", "gpu_memory_gb": null, "description": "...",
     "settings": {"train_batch_size": 2, "cache_config": {"vae_cache_type": "memory"}, ...},
     "why": {"train_batch_size": "...", "cache_config.vae_cache_type": "...", ...}}

``settings`` holds real ``TrainingConfig`` keys (nested sections such as ``cache_config`` as
objects); ``why`` gives one reason per setting, keyed by its dotted path. ``gpu`` (a name
:func:`~simpletuner.memory.hardware.resolve_gpu_name` knows) and ``gpu_memory_gb`` say which
machine ``simpletuner estimate`` plans for with the preset. :func:`load_preset` checks the
file's shape; a test merges every preset into a minimal config and validates it.
"""

from __future__ import annotations

import copy
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Where the presets live in a source checkout.
PRESETS_DIR = Path(__file__).resolve().parents[2] / "config" / "presets"

_REQUIRED = ("name", "hardware", "description", "settings", "why")
_OPTIONAL = ("gpu", "gpu_memory_gb")


@dataclass(frozen=True)
class Preset:
    """One preset: its settings (config keys) and the reason for each (by dotted path)."""

    name: str
    hardware: str
    description: str
    settings: dict[str, Any]
    why: dict[str, str]
    gpu: str | None
    gpu_memory_gb: float | None
    path: Path

    def flat_settings(self) -> dict[str, Any]:
        """``{"cache_config.vae_cache_type": "memory", ...}`` in file order."""
        return flatten_settings(self.settings)


def _nested_sections() -> frozenset[str]:
    """Top-level config keys that are sections of their own (pydantic models): flattened with dots."""
    from pydantic import BaseModel

    from simpletuner.configuration.schema import TrainingConfig

    return frozenset(
        name for name, field in TrainingConfig.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    )


def flatten_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys for the config's nested sections; other values (``cuda_allocator``'s dict too) stay whole."""
    sections = _nested_sections()
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if key in sections and isinstance(value, dict):
            for inner, inner_value in value.items():
                flat[f"{key}.{inner}"] = inner_value
        else:
            flat[key] = value
    return flat


def merge_settings(raw: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``raw`` with ``settings`` applied; nested sections are updated key by key."""
    out = copy.deepcopy(raw)
    sections = _nested_sections()
    for key, value in settings.items():
        if key in sections and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **copy.deepcopy(value)}
        else:
            out[key] = copy.deepcopy(value)
    return out


def preset_names(directory: Path = PRESETS_DIR) -> list[str]:
    """Names of the presets in ``directory`` (file stems), sorted."""
    return sorted(p.stem for p in Path(directory).glob("*.json"))


def load_preset(name: str, directory: Path = PRESETS_DIR) -> Preset:
    """Read and check one preset; ValueError naming the known presets for an unknown name."""
    directory = Path(directory)
    path = directory / f"{name}.json"
    if not path.is_file():
        known = preset_names(directory)
        raise ValueError(
            f"unknown preset {name!r}: known presets are {', '.join(known) or '(none found in ' + str(directory) + ')'}"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"preset {path} is not valid JSON: {exc}") from None
    problems = [f"missing key {k!r}" for k in _REQUIRED if k not in data]
    extra = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    problems += [f"unknown key {k!r}" for k in extra]
    if not problems:
        if data["name"] != name:
            problems.append(f"name {data['name']!r} differs from the file name {name!r}")
        flat = flatten_settings(data["settings"])
        problems += [f"setting {k!r} has no reason in 'why'" for k in flat if k not in data["why"]]
        problems += [f"'why' explains {k!r}, which is not a setting" for k in data["why"] if k not in flat]
    if problems:
        raise ValueError(f"preset {path}: {'; '.join(problems)}")
    return Preset(
        name=data["name"], hardware=data["hardware"], description=data["description"], settings=data["settings"],
        why=data["why"], gpu=data.get("gpu"), gpu_memory_gb=data.get("gpu_memory_gb"), path=path,
    )


def load_presets(directory: Path = PRESETS_DIR) -> list[Preset]:
    """Every preset in ``directory``, by name."""
    return [load_preset(name, directory) for name in preset_names(directory)]


def _show(value: Any) -> str:
    return json.dumps(value)


def _wrap(text: str, indent: str, width: int = 100) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent) or [indent]


def explain_preset(preset: Preset) -> list[str]:
    """Human lines: what the preset is for, then each setting with its reason."""
    lines = [f"preset {preset.name}: {preset.hardware}", *_wrap(preset.description, "  "), ""]
    for key, value in preset.flat_settings().items():
        lines.append(f"  {key} = {_show(value)}")
        lines += _wrap(preset.why[key], "      ")
    lines += [
        "",
        f"  plan for this machine: simpletuner estimate --config cfg.json {_machine_flags(preset)} --target-effective-batch N",
        f"  compare a config with it: simpletuner estimate --preset {preset.name} --config cfg.json",
    ]
    return lines


def _machine_flags(preset: Preset) -> str:
    flags = []
    if preset.gpu:
        flags.append(f"--gpu {preset.gpu}")
    if preset.gpu_memory_gb is not None:
        flags.append(f"--gpu-memory {preset.gpu_memory_gb:g}")
    return " ".join(flags)


def _lookup(config: Any, dotted: str) -> Any:
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _is_set(raw: dict[str, Any], dotted: str) -> bool:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@dataclass(frozen=True)
class SettingDifference:
    """One preset setting against a config: the config's value (or its default) and the preset's."""

    key: str
    config_value: Any
    preset_value: Any
    is_default: bool  # the config does not set the key; ``config_value`` is the schema default

    @property
    def is_same(self) -> bool:
        return self.config_value == self.preset_value


def compare_with_preset(preset: Preset, config: Any, raw: dict[str, Any]) -> list[SettingDifference]:
    """Each of the preset's settings against a validated ``config`` (``raw``: its JSON, to tell defaults)."""
    out = []
    for key, value in preset.flat_settings().items():
        current = _lookup(config, key)
        if hasattr(current, "model_dump"):
            current = current.model_dump()
        out.append(SettingDifference(key, current, value, not _is_set(raw, key)))
    return out


def describe_comparison(preset: Preset, differences: list[SettingDifference], config_path: str = "cfg.json") -> list[str]:
    """Human lines: the settings that differ (with the preset's reason), then those already matching."""
    differ = [d for d in differences if not d.is_same]
    same = [d for d in differences if d.is_same]
    lines = [f"config vs preset {preset.name} ({preset.hardware}): {len(differ)} of {len(differences)} settings differ"]
    for d in differ:
        current = _show(d.config_value) + (" (default)" if d.is_default else "")
        lines.append(f"  {d.key}: config {current}, preset {_show(d.preset_value)}")
        lines += _wrap(preset.why[d.key], "      ")
    if same:
        lines.append("  already as the preset: " + ", ".join(d.key for d in same))
    if differ:
        sets = " ".join(f"--set {shlex.quote(f'{d.key}={_show(d.preset_value)}')}" for d in differ)
        lines += [
            "",
            "  try the preset's values without editing the file (the same --set items work with `simpletuner train`):",
            f"    simpletuner estimate --config {shlex.quote(str(config_path))} {sets}",
        ]
    return lines
