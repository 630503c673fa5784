"""Hardware presets: named sets of config keys, each with the reason it is chosen.

A preset is one JSON file in ``config/presets/`` with ``name``, ``hardware``, ``model_family``,
``workload``, ``gpu`` / ``gpu_memory_gb`` (what ``simpletuner estimate`` plans for), ``description``,
``settings`` (real ``TrainingConfig`` keys, sections as objects) and ``why`` (one reason per setting, by
dotted path). :func:`load_preset` checks the file's shape; :func:`apply_preset` refuses a config of
another ``model_family``, since a preset tuned for one model does not carry over.
See documentation/MEMORY.md, "Presets".
"""

from __future__ import annotations

import copy
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel

from simpletuner.configuration.model_folder import HUB_DEFAULT_FAMILY, settle_model_family
from simpletuner.configuration.schema import TrainingConfig
from simpletuner.resources import presets_dir

#: Where the presets live: config/presets/ in a checkout, simpletuner/_bundled/presets/ in a wheel.
PRESETS_DIR = presets_dir()

_REQUIRED = ("name", "hardware", "model_family", "workload", "description", "settings", "why")
_OPTIONAL = ("gpu", "gpu_memory_gb")


@dataclass(frozen=True)
class Preset:
    """One preset: its settings (config keys) and the reason for each (by dotted path)."""

    name: str
    hardware: str
    model_family: str  # the config's model_family the values were chosen for
    workload: str  # what was trained with them, in words ("Wan 2.2 T2V A14B LoRA, ...")
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
    return frozenset(
        name
        for name, field in TrainingConfig.model_fields.items()
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


def model_families() -> tuple[str, ...]:
    """The ``model_family`` values the config schema accepts."""
    return get_args(TrainingConfig.model_fields["model_family"].annotation)


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
            "; `simpletuner estimate --list-presets` shows the machine and workload each was made for"
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
        families = model_families()
        if data["model_family"] not in families:
            problems.append(f"model_family {data['model_family']!r} is not one of {', '.join(families)}")
        flat = flatten_settings(data["settings"])
        problems += [f"setting {k!r} has no reason in 'why'" for k in flat if k not in data["why"]]
        problems += [f"'why' explains {k!r}, which is not a setting" for k in data["why"] if k not in flat]
    if problems:
        raise ValueError(f"preset {path}: {'; '.join(problems)}")
    return Preset(
        name=data["name"],
        hardware=data["hardware"],
        model_family=data["model_family"],
        workload=data["workload"],
        description=data["description"],
        settings=data["settings"],
        why=data["why"],
        gpu=data.get("gpu"),
        gpu_memory_gb=data.get("gpu_memory_gb"),
        path=path,
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
    lines = [
        f"preset {preset.name}: {preset.hardware}",
        *_wrap(f"made for: {preset.workload} (model_family {preset.model_family!r})", "  "),
        *_wrap(preset.description, "  "),
        "",
    ]
    for key, value in preset.flat_settings().items():
        lines.append(f"  {key} = {_show(value)}")
        lines += _wrap(preset.why[key], "      ")
    lines += [
        "",
        f"  plan for this machine: simpletuner estimate --config cfg.json {_machine_flags(preset)} "
        "--target-effective-batch N",
        f"  compare a config with it: simpletuner estimate --preset {preset.name} --config cfg.json",
        f"  write it into a config (keys the config sets are kept): simpletuner estimate --preset {preset.name} "
        "--config cfg.json --apply",
    ]
    return lines


def _machine_flags(preset: Preset) -> str:
    flags = []
    if preset.gpu:
        flags.append(f"--gpu {preset.gpu}")
    if preset.gpu_memory_gb is not None:
        flags.append(f"--gpu-memory {preset.gpu_memory_gb:g}")
    return " ".join(flags)


def _lookup(config: TrainingConfig, dotted: str) -> Any:
    value: Any = config
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


def compare_with_preset(preset: Preset, config: TrainingConfig, raw: dict[str, Any]) -> list[SettingDifference]:
    """Each of the preset's settings against a validated ``config`` (``raw``: its JSON, to tell defaults)."""
    out = []
    for key, value in preset.flat_settings().items():
        current = _lookup(config, key)
        if hasattr(current, "model_dump"):
            current = current.model_dump()
        out.append(SettingDifference(key, current, value, not _is_set(raw, key)))
    return out


def describe_comparison(
    preset: Preset, differences: list[SettingDifference], config_path: str = "cfg.json"
) -> list[str]:
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


# --- applying a preset -----------------------------------------------------------------------------
def _default_model_family(raw: dict[str, Any]) -> str:
    """The family a config that does not set ``model_family`` trains: its model folder's (sd for a hub id)."""
    return settle_model_family(raw)[0].get("model_family") or HUB_DEFAULT_FAMILY


def _get(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        node = node[part]
    return node


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"cache_config.vae_cache_type": "disk"}`` -> ``{"cache_config": {"vae_cache_type": "disk"}}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        section, dot, inner = key.partition(".")
        if dot:
            out.setdefault(section, {})[inner] = value
        else:
            out[key] = value
    return out


def check_preset_fits(preset: Preset, raw: dict[str, Any]) -> None:
    """ValueError naming both when ``preset`` was made for another ``model_family`` than the raw config's."""
    is_set = raw.get("model_family") is not None
    family = raw["model_family"] if is_set else _default_model_family(raw)
    if family == preset.model_family:
        return
    try:
        fitting = [p.name for p in load_presets(preset.path.parent) if p.model_family == family]
    except ValueError:
        fitting = []
    other = (
        f"use a preset made for {family!r} ({', '.join(fitting)})"
        if fitting
        else f"no preset here is made for {family!r}"
    )
    raise ValueError(
        f"preset {preset.name!r} was made for {preset.workload} (model_family {preset.model_family!r}), but the config "
        f"trains model_family {family!r}"
        f"{'' if is_set else ' (the default: the config does not set it, so the model folder decides)'}; its "
        f"micro-batch and memory settings would not carry over. Fix: {other}, or plan for this model with "
        "`simpletuner estimate --config cfg.json --gpu NAME --target-effective-batch N` (--apply writes the plan)"
    )


def apply_preset(
    raw: dict[str, Any], preset: Preset | str, directory: Path | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Merge a preset (a :class:`Preset` or a name in ``directory``) into ``raw``, a config's JSON object
    before validation, which is not changed; what the config sets wins.

    Returns ``(merged, lines)``: a deep copy with every preset setting the config leaves unset (sections such
    as ``cache_config`` merged key by key; other values taken whole), and a heading line plus one line per
    preset setting with its effective value and where it came from.

    Raises:
        ValueError: an unknown preset name (listing the known ones), a malformed preset file, or a preset
            made for another ``model_family`` (naming both and the presets that would fit).
    """
    if not isinstance(preset, Preset):
        preset = load_preset(preset, PRESETS_DIR if directory is None else directory)
    check_preset_fits(preset, raw)
    flat = preset.flat_settings()
    from_preset = {k: v for k, v in flat.items() if not _is_set(raw, k)}
    merged = merge_settings(raw, _unflatten(from_preset))
    lines = [
        f"preset {preset.name} ({preset.hardware}; made for {preset.workload}): {len(from_preset)} of "
        f"{len(flat)} settings from the preset, {len(flat) - len(from_preset)} kept as the config sets them"
    ]
    for key, value in flat.items():
        if key in from_preset:
            lines.append(f"  {key} = {_show(value)}  (preset {preset.name})")
        else:
            current = _get(raw, key)
            note = "the same as the preset" if current == value else f"the preset's {_show(value)} not used"
            lines.append(f"  {key} = {_show(current)}  (config; {note})")
    return merged, lines
