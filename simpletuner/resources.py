"""Where simpletuner's own config files are: in a source checkout, or inside an installed wheel.

The repository keeps them in ``config/`` (presets, examples, dataset configs, Accelerate YAMLs); a wheel
carries that folder as the package data of ``simpletuner._bundled``. Every reader asks this module instead
of building a path from ``__file__``, and ``simpletuner config-path NAME`` prints one. The lookup is by
path, not by importing ``simpletuner._bundled``: an editable install keeps using the checkout's ``config/``,
which has no ``__init__.py``. A leaf: it imports nothing from simpletuner.
"""

from __future__ import annotations

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
