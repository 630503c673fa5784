"""The installed package, not the checkout: build a wheel, install it into a fresh venv, use it elsewhere.

The wheel is built once per session from a copy of the sources (nothing is written into the
checkout), installed with --no-deps into a new venv whose .pth file points at this environment's
site-packages for torch & co. (nothing is downloaded), and every command runs with its cwd in a
temporary folder and no PYTHONPATH, so only the installed copy can answer.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config"
#: What a build reads: the metadata (pyproject.toml names README.md), the package and the folder it bundles.
SOURCES = ("pyproject.toml", "README.md", "simpletuner", "config")
BUNDLED = "simpletuner/_bundled"


def _run(cmd, *, env, cwd, timeout=300) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return result


def _checked(cmd, **kwargs) -> subprocess.CompletedProcess:
    result = _run(cmd, **kwargs)
    assert result.returncode == 0, (
        f"{cmd} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel path, venv python, venv purelib, env, cwd outside the checkout)."""
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools (the `test` extra installs it)")
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_bundled"))
        else:
            shutil.copy2(ROOT / name, src / name)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    dist = base / "dist"
    _checked(
        [sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "--no-index", "-w", dist],
        env=env,
        cwd=base,
    )
    (wheel,) = dist.glob("simpletuner_gh200-*.whl")  # the distribution name (pyproject.toml)

    venv = base / "venv"
    _checked([sys.executable, "-m", "venv", "--without-pip", venv], env=env, cwd=base)
    python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    purelib = Path(
        _checked(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env=env, cwd=base
        ).stdout.strip()
    )
    # The dependencies come from this environment, appended after the venv's own site-packages, as
    # plain paths: their .pth files (among them an editable install's finder) are not run.
    deps = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    (purelib / "_simpletuner_test_deps.pth").write_text("\n".join(deps) + "\n")
    _checked(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel],
        env=env,
        cwd=base,
    )

    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    cwd = base / "elsewhere"
    cwd.mkdir()
    return wheel, python, purelib, env, cwd


def test_wheel_carries_the_config_files(installed):
    wheel = installed[0]
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"{BUNDLED}/{p.relative_to(CONFIG).as_posix()}" for p in CONFIG.rglob("*") if p.is_file()}
    assert {
        f"{BUNDLED}/presets/gh200.json",
        f"{BUNDLED}/examples/sd15_lora.json",
        f"{BUNDLED}/datasets/sd_local.json",
        f"{BUNDLED}/accelerate_config_gh200.yaml",
        f"{BUNDLED}/accelerate_config_gh200_fsdp.yaml",
    } <= expected
    assert sorted(expected - names) == []
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "simpletuner").rglob("*.py")}
    assert sorted(modules - names) == [], "modules missing from the wheel: add their package to pyproject.toml"


def test_installed_copy_is_the_one_imported(installed):
    _, python, purelib, env, cwd = installed
    out = _checked(
        [
            python,
            "-c",
            "import simpletuner, simpletuner.resources as r; print(simpletuner.__file__); print(r.config_dir())",
        ],
        env=env,
        cwd=cwd,
    ).stdout.split()
    assert Path(out[0]) == purelib / "simpletuner" / "__init__.py"
    assert Path(out[1]) == (purelib / BUNDLED).resolve()


def test_commands_work_outside_the_checkout(installed):
    _, python, purelib, env, cwd = installed
    bundled = (purelib / BUNDLED).resolve()

    out = _checked(["simpletuner", "--version"], env=env, cwd=cwd).stdout
    assert out.strip() == "simpletuner-gh200 0.1.0"  # the installed distribution's metadata
    out = _checked(["simpletuner", "--help"], env=env, cwd=cwd).stdout
    assert "diagnose" in out and "config-path" in out

    out = _checked(["simpletuner", "estimate", "--list-presets"], env=env, cwd=cwd).stdout
    names = sorted(p.stem for p in (CONFIG / "presets").glob("*.json"))
    listed = [line.split()[0] for line in out.splitlines() if line[:1].isalnum()]  # one unindented line per preset
    assert listed == names
    assert f"presets live in {bundled / 'presets'}" in out

    out = _checked(["simpletuner", "estimate", "--preset", "gh200"], env=env, cwd=cwd).stdout
    assert out.startswith("preset gh200: ")

    out = _checked(["simpletuner", "config-path", "accelerate_config_gh200.yaml"], env=env, cwd=cwd).stdout.strip()
    assert Path(out) == bundled / "accelerate_config_gh200.yaml" and Path(out).is_file()
    example = Path(_checked(["simpletuner", "config-path", "examples/sd15_lora.json"], env=env, cwd=cwd).stdout.strip())
    assert example.read_bytes() == (CONFIG / "examples" / "sd15_lora.json").read_bytes()


def test_documented_launch_line_for_installed_users(installed):
    """accelerate launch --config_file "$(simpletuner config-path ...)" -m simpletuner.train reaches our entry point."""
    _, python, _, env, cwd = installed
    yaml = _checked(["simpletuner", "config-path", "accelerate_config_gh200.yaml"], env=env, cwd=cwd).stdout.strip()
    # `python -m accelerate.commands.accelerate_cli` is the `accelerate` command of this venv's interpreter.
    result = _checked(
        [
            python,
            "-m",
            "accelerate.commands.accelerate_cli",
            "launch",
            "--config_file",
            yaml,
            "-m",
            "simpletuner.train",
            "--help",
        ],
        env=env,
        cwd=cwd,
    )
    assert "usage: simpletuner train" in result.stdout and "--config" in result.stdout


def _sections(report: str) -> tuple[list[str], list[str]]:
    """The report's section headers, and its verdict lines (the same on the same machine)."""
    lines = report.splitlines()
    headers = [line for line in lines if line.startswith("== ")]
    return headers, lines[lines.index("== verdict ==") + 1 :]


def test_diagnose_is_the_diagnostic_script(installed, capsys):
    _, _, _, env, cwd = installed
    result = _run(["simpletuner", "diagnose"], env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr

    from simpletuner.cli.diagnose import main as script_main  # what `python gh200_diagnostic.py` runs

    assert script_main([]) == 0
    assert _sections(result.stdout) == _sections(capsys.readouterr().out)


def test_diagnose_takes_the_script_flags_and_exit_codes(capsys):
    from simpletuner import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["diagnose", "--oversubscription-scale", "0"])
    assert exc.value.code == 2
    assert (
        "simpletuner diagnose: error: argument --oversubscription-scale: must be a number > 0"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as exc:
        cli.main(["diagnose", "--help"])
    assert exc.value.code == 0
    assert "usage: simpletuner diagnose [-h] [--json] [--oversubscription-scale S] [--force]" in " ".join(
        capsys.readouterr().out.split()
    )
