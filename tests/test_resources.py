"""simpletuner.resources finds config/ in a checkout and in an installed wheel; `simpletuner config-path`.

The wheel itself is built and installed in tests/test_wheel.py; these are the fast checks.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from simpletuner import cli, resources
from simpletuner.memory import presets

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config"


def test_checkout_resolves_to_the_repository_config_folder():
    assert resources.config_dir() == CONFIG
    assert resources.presets_dir() == CONFIG / "presets"
    assert resources.examples_dir() == CONFIG / "examples"
    assert resources.datasets_dir() == CONFIG / "datasets"
    assert presets.PRESETS_DIR == CONFIG / "presets"
    assert presets.preset_names() == sorted(p.stem for p in (CONFIG / "presets").glob("*.json"))


@pytest.mark.parametrize(
    "name, expected",
    [
        ("accelerate_config_gh200.yaml", "accelerate_config_gh200.yaml"),
        ("config/accelerate_config_gh200_fsdp.yaml", "accelerate_config_gh200_fsdp.yaml"),  # the docs' checkout path
        ("presets/gh200.json", "presets/gh200.json"),
        ("sd15_lora.json", "examples/sd15_lora.json"),  # a file name that occurs once
        ("datasets/sd_local.json", "datasets/sd_local.json"),
    ],
)
def test_config_file_accepts_the_spellings_users_type(name, expected):
    assert resources.config_file(name) == CONFIG / expected


def test_accelerate_config_short_and_file_names():
    assert resources.accelerate_config() == CONFIG / "accelerate_config_gh200.yaml"
    assert resources.accelerate_config("gh200_fsdp") == CONFIG / "accelerate_config_gh200_fsdp.yaml"
    assert resources.accelerate_config("accelerate_config_gh200.yaml") == CONFIG / "accelerate_config_gh200.yaml"
    with pytest.raises(FileNotFoundError, match="unknown Accelerate config 'gh300': known are gh200"):
        resources.accelerate_config("gh300")


def test_unknown_or_escaping_names_say_what_exists():
    with pytest.raises(
        FileNotFoundError, match=r"no config file 'presets/gh300.json' in .*Files there: .*presets/gh200.json"
    ):
        resources.config_file("presets/gh300.json")
    with pytest.raises(FileNotFoundError, match="inside simpletuner's config folder"):
        resources.config_file("../pyproject.toml")
    with pytest.raises(FileNotFoundError, match="inside simpletuner's config folder"):
        resources.config_file(str(ROOT / "pyproject.toml"))


def test_list_config_files_is_every_file_of_the_folder():
    on_disk = sorted(
        p.relative_to(CONFIG).as_posix() for p in CONFIG.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    assert resources.list_config_files() == on_disk


def _load_resources_as_installed(site: Path):
    """Import a copy of resources.py from `site`/simpletuner/, as a wheel lays it out."""
    spec = importlib.util.spec_from_file_location("installed_resources", site / "simpletuner" / "resources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_installed_layout_prefers_the_bundled_copy(tmp_path):
    site = tmp_path / "site-packages"
    (site / "simpletuner").mkdir(parents=True)
    shutil.copy(ROOT / "simpletuner" / "resources.py", site / "simpletuner" / "resources.py")
    shutil.copytree(CONFIG, site / "simpletuner" / "_bundled")
    installed = _load_resources_as_installed(site)
    bundled = (site / "simpletuner" / "_bundled").resolve()
    assert installed.config_dir() == bundled
    assert installed.accelerate_config("gh200") == bundled / "accelerate_config_gh200.yaml"
    assert installed.presets_dir() == bundled / "presets"


def test_missing_files_name_both_places_and_the_fix(tmp_path):
    (tmp_path / "simpletuner").mkdir()
    shutil.copy(ROOT / "simpletuner" / "resources.py", tmp_path / "simpletuner" / "resources.py")
    broken = _load_resources_as_installed(tmp_path)
    assert broken.config_dir() == (tmp_path / "simpletuner" / "_bundled").resolve()  # never raises at import time
    with pytest.raises(FileNotFoundError, match="config files are missing.*Reinstall simpletuner"):
        broken.config_file("accelerate_config_gh200.yaml")


def test_pyproject_ships_every_package_and_every_config_file():
    """The wheel's contents are declared by hand (to map config/ into the package): keep them complete."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = sorted(
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "simpletuner").rglob("__init__.py")
    )
    missing = sorted(set(on_disk) - set(tool["packages"]))
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml, or the wheel leaves them out"
    assert tool["package-dir"][resources.BUNDLED_PACKAGE] == "config"
    shipped = set()
    for package in tool["packages"]:
        if package == resources.BUNDLED_PACKAGE or package.startswith(resources.BUNDLED_PACKAGE + "."):
            folder = CONFIG.joinpath(*package.split(".")[2:])
            for pattern in tool["package-data"].get(package, []):
                shipped |= {p.relative_to(CONFIG).as_posix() for p in folder.glob(pattern)}
    unshipped = sorted(set(resources.list_config_files()) - shipped)
    assert not unshipped, (
        f"{unshipped} would be left out of the wheel: list its folder under [tool.setuptools] packages "
        f"(as {resources.BUNDLED_PACKAGE}.<folder>) and its pattern under [tool.setuptools.package-data]"
    )


def test_config_path_command(capsys):
    assert cli.main(["config-path", "accelerate_config_gh200.yaml"]) == 0
    assert capsys.readouterr().out.strip() == str(CONFIG / "accelerate_config_gh200.yaml")
    assert cli.main(["config-path", "gh200_fsdp"]) == 0
    assert capsys.readouterr().out.strip() == str(CONFIG / "accelerate_config_gh200_fsdp.yaml")
    assert cli.main(["config-path"]) == 0
    assert capsys.readouterr().out.strip() == str(CONFIG)
    assert cli.main(["config-path", "--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert str(CONFIG / "presets" / "gh200.json") in listed and len(listed) == len(resources.list_config_files())


def test_config_path_unknown_name_exits_2_with_the_choices(capsys):
    assert cli.main(["config-path", "gh200.yaml"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "error: no config file 'gh200.yaml'" in captured.err
    assert "accelerate_config_gh200.yaml" in captured.err and "simpletuner config-path --list" in captured.err
