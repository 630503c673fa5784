"""Where simpletuner's own config files are: in a source checkout, or inside an installed wheel.

The repository keeps them in ``config/`` at its root (presets, example configs, dataset configs,
Accelerate YAMLs). A wheel carries the same folder as the package data of ``simpletuner._bundled``
(``pyproject.toml`` maps that package onto ``config/``), so an installed copy finds them at
``site-packages/simpletuner/_bundled/``. Every reader asks this module instead of building a path
from ``__file__``, and ``simpletuner config-path NAME`` prints one path for shell use::

    accelerate launch --config_file "$(simpletuner config-path accelerate_config_gh200.yaml)" \\
        -m simpletuner.train --config cfg.json

The lookup is by path, not by importing ``simpletuner._bundled``: an editable install
(``pip install -e .``) keeps using the checkout's ``config/``, which has no ``__init__.py``.
This module imports nothing from simpletuner, so any layer may use it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent

#: The package a wheel installs ``config/`` as (see ``[tool.setuptools]`` in pyproject.toml).
BUNDLED_PACKAGE = "simpletuner._bundled"

#: Short names ``accelerate_config`` accepts, and the file each stands for.
ACCELERATE_CONFIGS = {
    "gh200": "accelerate_config_gh200.yaml",
    "gh200_fsdp": "accelerate_config_gh200_fsdp.yaml",
}


def _candidates() -> list[Path]:
    """Installed copy first (a wheel has no checkout around it), then the checkout's config/."""
    return [_PACKAGE_DIR / "_bundled", _PACKAGE_DIR.parent / "config"]


def config_dir() -> Path:
    """The folder holding ``presets/``, ``examples/``, ``datasets/`` and the Accelerate YAMLs.

    Never raises, so module-level constants can use it: with no copy found (a broken install) it
    returns where a wheel would have put them, and the reader's own "not found" error names it.
    """
    candidates = _candidates()
    for candidate in candidates:
        if (candidate / "presets").is_dir():
            return candidate
    return candidates[0]


def presets_dir() -> Path:
    """The hardware presets, one JSON file each (``simpletuner estimate --list-presets``)."""
    return config_dir() / "presets"


def examples_dir() -> Path:
    """The example training configs."""
    return config_dir() / "examples"


def datasets_dir() -> Path:
    """The example dataset configs."""
    return config_dir() / "datasets"


def list_config_files() -> list[str]:
    """Every bundled file, as a path relative to :func:`config_dir` (``presets/gh200.json``), sorted."""
    root = config_dir()
    if not root.is_dir():
        return []
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.suffix in (".json", ".yaml", ".yml") and "__pycache__" not in p.parts
    )


def config_file(name: str) -> Path:
    """The path of one bundled file, by its path relative to ``config/`` or by its file name.

    Accepts ``accelerate_config_gh200.yaml``, ``presets/gh200.json``, ``config/examples/sd15_lora.json``
    (the checkout spelling the docs use) or a bare file name that occurs once, e.g. ``sd15_lora.json``.
    Raises FileNotFoundError naming the files there are.
    """
    root = config_dir()
    relative = Path(name.replace("\\", "/"))
    if relative.is_absolute() or ".." in relative.parts:
        raise FileNotFoundError(f"{name!r}: give a path inside simpletuner's config folder, e.g. presets/gh200.json")
    if relative.parts[:1] == ("config",):
        relative = Path(*relative.parts[1:]) if len(relative.parts) > 1 else Path(".")
    path = root / relative
    if path.is_file():
        return path
    known = list_config_files()
    matches = [rel for rel in known if rel.rsplit("/", 1)[-1] == relative.name]
    if len(matches) == 1 and len(relative.parts) == 1:
        return root / matches[0]
    if not known:
        raise FileNotFoundError(
            f"simpletuner's config files are missing: no {root} (installed wheel) and no config/ folder beside the "
            "package (source checkout). Reinstall simpletuner from its checkout (pip install --force-reinstall .) "
            "or the wheel you installed."
        )
    hint = f" (did you mean {' or '.join(matches)}?)" if matches else ""
    raise FileNotFoundError(
        f"no config file {name!r} in {root}{hint}. Files there: {', '.join(known)} "
        f"(`simpletuner config-path --list` prints them)."
    )


def accelerate_config(name: str = "gh200") -> Path:
    """An Accelerate YAML: ``gh200``, ``gh200_fsdp`` or its file name (``accelerate_config_gh200.yaml``)."""
    filename = ACCELERATE_CONFIGS.get(name, name)
    if not filename.endswith((".yaml", ".yml")):
        known = ", ".join(f"{short} ({file})" for short, file in ACCELERATE_CONFIGS.items())
        raise FileNotFoundError(f"unknown Accelerate config {name!r}: known are {known}")
    return config_file(filename)


def print_config_path(name: str | None, list_all: bool = False, stream=None) -> int:
    """``simpletuner config-path [NAME] [--list]``: print one path (or the folder, or every file); exit code."""
    stream = stream if stream is not None else sys.stdout
    if list_all:
        root = config_dir()
        for rel in list_config_files():
            print(root / rel, file=stream)
        return 0
    if name is None:
        print(config_dir(), file=stream)
        return 0
    try:
        path = accelerate_config(name) if name in ACCELERATE_CONFIGS else config_file(name)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path, file=stream)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``simpletuner config-path``'s options."""
    parser.description = (
        "Print where a file of simpletuner's config folder is: config/ in a checkout, inside the "
        "package when installed from a wheel. E.g. accelerate launch --config_file "
        '"$(simpletuner config-path accelerate_config_gh200.yaml)" -m simpletuner.train --config cfg.json'
    )
    parser.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help="accelerate_config_gh200.yaml, presets/gh200.json, examples/sd15_lora.json, a file name that "
        "occurs once, or gh200 / gh200_fsdp for the Accelerate YAMLs; none: the folder itself",
    )
    parser.add_argument("--list", action="store_true", help="print the path of every bundled file")


def run(args: argparse.Namespace) -> int:
    """``simpletuner config-path`` from the parsed arguments; returns the exit code."""
    return print_config_path(args.name, list_all=args.list)
