"""Settings the launcher can also make (``mixed_precision``, ``gradient_accumulation_steps``,
``enable_compile``), merged with the JSON so that neither wins in silence: a key only the launcher was told
is injected as a ``--set``; told both, different values stop the run before any model loads, naming both.
The rule and why: documentation/CONFIG.md, "Keys the launcher can also set".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import orjson

from simpletuner.configuration.errors import ConfigError

PRECISION_VAR = "ACCELERATE_MIXED_PRECISION"
ACCUMULATION_VAR = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
DYNAMO_VAR = "ACCELERATE_DYNAMO_BACKEND"

_PRECISIONS = ("no", "fp16", "bf16")


@dataclass(frozen=True)
class LauncherCommand:
    """What the ``accelerate launch`` line above this process said, where it can be read."""

    argv: tuple[str, ...]
    flags: Mapping[str, Any]  # launch option -> value given on the command line (None: not given)
    config_file: Path | None  # the Accelerate config file it read (--config_file or the default one)
    config_file_is_default: bool = False
    file_values: Mapping[str, Any] = field(default_factory=dict)  # keys present in that file


@dataclass(frozen=True)
class Setting:
    """One key's value in force and a sentence saying where it came from."""

    key: str
    value: Any
    source: str


@dataclass
class LaunchResolution:
    """The outcome of :func:`resolve_launcher_settings`."""

    overrides: list[str] = field(default_factory=list)  # ``key=json`` items to apply like ``--set``
    settings: dict[str, Setting] = field(default_factory=dict)  # key -> value in force and its source


# --- reading the launcher ----------------------------------------------------------------------
def _read_cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _parent_pid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _launch_args(argv: Sequence[str]) -> list[str] | None:
    """The arguments after ``accelerate launch`` in ``argv``, or None when it is not that command."""
    for i, token in enumerate(argv):
        name = os.path.basename(token)
        if name == "accelerate-launch" or token == "accelerate.commands.launch":
            return list(argv[i + 1 :])
        if name == "accelerate" and i + 1 < len(argv) and argv[i + 1] == "launch":
            return list(argv[i + 2 :])
    return None


def find_launch_command(
    pid: int | None = None,
    read: Callable[[int], list[str] | None] = _read_cmdline,
    parent: Callable[[int], int | None] = _parent_pid,
    levels: int = 4,
) -> list[str] | None:
    """The arguments of the ``accelerate launch`` among this process's ancestors (None if none)."""
    found = find_launcher(pid, read, parent, levels)
    return None if found is None else found[1]


def find_launcher(
    pid: int | None = None,
    read: Callable[[int], list[str] | None] = _read_cmdline,
    parent: Callable[[int], int | None] = _parent_pid,
    levels: int = 4,
) -> tuple[int, list[str]] | None:
    """The process id and arguments of the ``accelerate launch`` among this process's ancestors (None if none).

    A one-process launch starts the script as its child; a multi-process one starts it from
    torch's elastic agent, which runs inside the launcher, so a few levels up is enough.
    """
    pid = os.getppid() if pid is None else pid
    for _ in range(levels):
        if not pid or pid <= 1:
            return None
        argv = read(pid)
        if argv:
            found = _launch_args(argv)
            if found is not None:
                return pid, found
        pid = parent(pid)
    return None


def _default_accelerate_config(environ: Mapping[str, str]) -> Path:
    """Where ``accelerate config`` writes, and ``accelerate launch`` reads when given no --config_file."""
    home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


def _read_accelerate_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    if path.suffix == ".json":
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError:
            return {}
    else:
        import yaml  # accelerate depends on PyYAML

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            return {}
    return data if isinstance(data, dict) else {}


def parse_launch_command(args: Sequence[str], environ: Mapping[str, str] = os.environ) -> LauncherCommand | None:
    """Parse ``accelerate launch`` arguments with Accelerate's own parser (None if they do not parse)."""
    from accelerate.commands.launch import launch_command_parser

    try:
        parsed = launch_command_parser().parse_args(list(args))
    except SystemExit:
        return None
    flags = {
        name: getattr(parsed, name, None)
        for name in ("mixed_precision", "dynamo_backend", "gradient_accumulation_steps")
    }
    config_file, is_default = None, False
    if parsed.config_file:
        config_file = Path(parsed.config_file)
    else:
        default = _default_accelerate_config(environ)
        if default.is_file():
            config_file, is_default = default, True
    values = _read_accelerate_file(config_file) if config_file is not None else {}
    flat = dict(values)
    dynamo = values.get("dynamo_config")
    if isinstance(dynamo, dict) and "dynamo_backend" in dynamo:
        flat["dynamo_backend"] = dynamo["dynamo_backend"]
    ds = values.get("deepspeed_config")
    if isinstance(ds, dict) and "gradient_accumulation_steps" in ds:
        flat["gradient_accumulation_steps"] = ds["gradient_accumulation_steps"]
    return LauncherCommand(tuple(args), flags, config_file, is_default, flat)


# --- merging -----------------------------------------------------------------------------------
def _launcher_request(
    option: str, var: str, environ: Mapping[str, str], command: LauncherCommand | None
) -> tuple[str, str] | None:
    """(value, where it came from) when the user asked the launcher for ``option``; else None."""
    value = environ.get(var)
    if value is None or value == "":
        return None
    if command is None:
        return value, f"the environment variable {var}={value}"
    if command.flags.get(option) is not None:
        return value, f"`accelerate launch --{option} {command.flags[option]}`"
    if option in command.file_values and command.config_file is not None:
        which = "Accelerate's default config file" if command.config_file_is_default else "the Accelerate config file"
        return value, f"{which} {command.config_file} ({option}: {command.file_values[option]})"
    return None  # the launcher's own default, written because it was told nothing


def _normalise(key: str, value: str) -> Any:
    if key == "mixed_precision":
        return value.strip().lower()
    if key == "gradient_accumulation_steps":
        try:
            return int(value)
        except ValueError:
            raise ConfigError([f"{ACCUMULATION_VAR}={value!r} is not a whole number"]) from None
    return value.strip().lower() not in ("no", "none", "")  # enable_compile <- dynamo backend


def resolve_launcher_settings(
    raw: Mapping[str, Any],
    environ: Mapping[str, str] = os.environ,
    command: LauncherCommand | None = None,
    config_source: str = "the config",
) -> LaunchResolution:
    """Merge what the launcher was asked for with the config's keys (see the module docstring).

    Raises ConfigError listing every key set differently in both places (or a launcher value
    this trainer cannot honour); returns the ``--set``-style overrides for keys only the
    launcher set, and the value and source of each key in force.
    """
    out = LaunchResolution()
    problems: list[str] = []
    for key, option, var in (
        ("mixed_precision", "mixed_precision", PRECISION_VAR),
        ("gradient_accumulation_steps", "gradient_accumulation_steps", ACCUMULATION_VAR),
        ("enable_compile", "dynamo_backend", DYNAMO_VAR),
    ):
        request = _launcher_request(option, var, environ, command)
        in_config = key in raw
        if request is None:
            if in_config:
                out.settings[key] = Setting(key, raw[key], f"from {config_source}")
            continue
        launcher_raw, where = request
        value = _normalise(key, launcher_raw)
        if key == "mixed_precision" and value not in _PRECISIONS:
            problems.append(
                f"mixed_precision: {where} asks for {value!r}, which this trainer does not support "
                f"({', '.join(_PRECISIONS)}): launch with --mixed_precision bf16 (or fp16 / no)"
            )
            continue
        if key == "enable_compile" and value and launcher_raw.strip().lower() != "inductor":
            problems.append(
                f"enable_compile: {where} asks torch dynamo for the {launcher_raw!r} backend; this trainer "
                "compiles with inductor through `enable_compile: true`. Launch with --dynamo_backend no "
                "(or inductor) and set enable_compile in the config"
            )
            continue
        if (
            key == "gradient_accumulation_steps"
            and isinstance(raw.get("gh200_optimizations"), dict)
            and raw["gh200_optimizations"].get("enable_batch_size_rampup")
        ):
            problems.append(
                f"gradient_accumulation_steps: {where} sets {value}, but gh200_optimizations."
                "enable_batch_size_rampup decides the accumulation window of every step: drop it from "
                "the launch, or turn the ramp off"
            )
            continue
        if in_config:
            if raw[key] != value:
                problems.append(
                    f"{key}: {config_source} says {raw[key]!r} but {where} says {value!r}. One run has one {key}: "
                    f"remove `{key}` from the config to use the launcher's, or change one so both agree"
                )
            else:
                out.settings[key] = Setting(key, value, f"from {config_source}, and {where} agrees")
            continue
        out.overrides.append(f"{key}={orjson.dumps(value).decode()}")
        out.settings[key] = Setting(key, value, f"from {where}; the config does not set it")
    if problems:
        raise ConfigError(problems, config_source)
    return out


def launcher_command_from_environment(environ: Mapping[str, str] = os.environ) -> LauncherCommand | None:
    """The ``accelerate launch`` above this process, parsed, or None where there is none or it cannot be read."""
    args = find_launch_command()
    return None if args is None else parse_launch_command(args, environ)
