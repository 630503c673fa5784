"""The GPU truth scripts on CPU: scripts/gpu_truth.sh and scripts/gpu_truth_perf.sh exit 0 with every GPU
step "skipped" for "no CUDA", scripts/gpu_probe.py writes one skipped line per case, the per-step limits
fit 8 minutes, and scripts/gpu_wheels.sh carries every package simpletuner imports that the GPU
machines' image lacks."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
LIMIT_S = 480  # 8 minutes of command time

#: The image's package list, 2026-11-17, from the device notes (the GPU machines' image 'cuda': Python
#: 3.12, torch 2.11+cu130; "Python packages already there" in the device tool's KINDS.md).
IMAGE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split()
#: Import names whose distribution is spelled otherwise.
DISTRIBUTIONS = {
    "PIL": "pillow",
    "yaml": "pyyaml",
    "cuda": "cuda-bindings",
    "snappy": "python-snappy",
    "lycoris": "lycoris-lora",
    "optimum": "optimum-quanto",
}
#: What the scripts the truth runs import, besides simpletuner/ (their sibling modules are not packages).
TRUTH_SCRIPTS = ("gpu_probe.py", "gpu_probe_cases.py", "gpu_check.py", "gpu_check_workers.py", "bench_mfu.py")

needs_cpu = pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA the scripts do the real work (minutes): run them by hand"
)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _env() -> dict:
    # the interpreter running the tests is the scripts' python3 (a venv's bin holds python3)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    """gpu_truth.sh and gpu_truth_perf.sh (both --no-install), run side by side once."""
    root = tmp_path_factory.mktemp("truth")
    commands = {
        "truth": [str(SCRIPTS / "gpu_truth.sh"), "--no-install", "--out", str(root / "truth")],
        "perf": [str(SCRIPTS / "gpu_truth_perf.sh"), "--no-install", "--out", str(root / "perf")],
    }
    procs = {
        name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
        for name, cmd in commands.items()
    }
    done = {name: (*proc.communicate(timeout=300), proc.returncode) for name, proc in procs.items()}
    return root, done


def _check_steps(out: Path, stem: str, steps: list[str], gpu_steps: set[str]) -> list[dict]:
    lines = _lines(out / f"{stem}.jsonl")
    assert [line["step"] for line in lines] == steps
    for line in lines:
        assert line["status"] in ("passed", "skipped"), line
        assert isinstance(line["seconds"], float)
        if line["step"] in gpu_steps:
            assert line["status"] == "skipped" and line["reason"].startswith("no CUDA: "), line
    install = lines[0]
    assert install["status"] == "skipped" and install["reason"].startswith("--no-install")
    versions = lines[1]
    assert versions["status"] == "passed" and versions["detail"]["torch"] == torch.__version__
    assert versions["detail"]["no_cuda"].startswith("no CUDA: ")
    # what the device tool brings back: at most 8 files, none deeper than 2 folders
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 3 for p in files)
    return lines


@needs_cpu
def test_the_truth_script_on_cpu_skips_every_gpu_step_for_no_cuda(cpu_runs):
    root, done = cpu_runs
    stdout, stderr, rc = done["truth"]
    assert rc == 0, stdout + stderr
    steps = ["install", "versions", "probe", "diagnostic", "gpu_tests", "managed_modes"]
    lines = _check_steps(root / "truth", "truth", steps, set(steps[2:]))
    assert lines[2]["detail"]["cases"] == len(_load("gpu_probe").CASES)
    assert "skipped itself" in lines[4]["reason"] and "deselected" in lines[4]["detail"]  # collected, then skipped
    diagnostic = json.loads((root / "truth" / "diagnostic.json").read_text())
    assert diagnostic["device"] is None
    assert (root / "truth" / "modes_check.json").exists() and (root / "truth" / "probe.jsonl").exists()
    assert '"step": "managed_modes"' in stdout  # each line on stdout too


@needs_cpu
def test_the_perf_script_on_cpu_skips_estimate_and_mfu_for_no_cuda(cpu_runs):
    root, done = cpu_runs
    stdout, stderr, rc = done["perf"]
    assert rc == 0, stdout + stderr
    steps = ["install", "versions", "estimate_vs_profile", "mfu"]
    lines = _check_steps(root / "perf", "perf", steps, set(steps[2:]))
    assert lines[3]["detail"]["mfu"]["status"] == "skipped"


@needs_cpu
def test_the_probe_on_cpu_writes_one_skipped_line_per_case(cpu_runs):
    """Step 3 of the truth run: gpu_probe.py --out FILE (its exit code 0 is what makes the step "skipped")."""
    root, done = cpu_runs
    (probe,) = [line for line in _lines(root / "truth" / "truth.jsonl") if line["step"] == "probe"]
    assert probe["status"] == "skipped"
    written = _lines(root / "truth" / "probe.jsonl")
    assert [line["case"] for line in written] == list(_load("gpu_probe").CASES)
    assert all(line["skipped"].startswith("no CUDA: ") and line["seconds"] == 0.0 for line in written)
    log = (root / "truth" / "truth.log").read_text()
    assert all(json.dumps(line) in log for line in written)  # printed as written


def test_every_probe_case_has_a_runner():
    assert set(_load("gpu_probe").CASES) == set(_load("gpu_probe_cases").RUNNERS)


@pytest.mark.parametrize("script", ["gpu_truth.sh", "gpu_truth_perf.sh"])
def test_the_per_step_limits_fit_8_minutes_and_the_header_says_so(script):
    text = (SCRIPTS / script).read_text()
    limits = {name: int(value) for name, value in re.findall(r"(?m)^LIMIT_(\w+)=(\d+)$", text)}
    assert sum(limits.values()) <= LIMIT_S
    # the header's "a N + b N ... = total" line lists the same limits
    (header,) = re.findall(r"(?m)^#\s+((?:\w+ \d+ \+ )+\w+ \d+) = (\d+)$", text)
    listed = {name: int(value) for name, value in re.findall(r"(\w+) (\d+)", header[0])}
    assert listed == limits and int(header[1]) == sum(limits.values())
    for name in limits:  # each limit is used by its step
        assert f'"$LIMIT_{name}"' in text or f"$((LIMIT_{name} " in text, name


def _imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports in ``path``, leaving out those inside a try (optional)."""
    tree = ast.parse(path.read_text())
    tries = [t for t in ast.walk(tree) if isinstance(t, ast.Try) and t.handlers]
    guarded = {id(n) for t in tries for s in t.body for n in ast.walk(s)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_wheels_carry_every_import_the_image_lacks():
    tomllib = pytest.importorskip("tomllib")
    text = (SCRIPTS / "gpu_wheels.sh").read_text()
    block = re.search(r"(?ms)^WHEELS=\((.*?)^\)", text).group(1)
    wheels = dict(re.findall(r"(?m)^\s+([A-Za-z0-9_.-]+)==(\S+)$", block))
    carried = {_norm(name) for name in wheels}
    image = {_norm(name) for name in IMAGE_PACKAGES}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs) -> set[str]:
        return {_norm(re.split(r"[<>=!\[ ;]", req)[0]) for req in reqs}

    extras = project["optional-dependencies"]
    # an extra's package that is no dependency (an extra may also raise a dependency's floor: gh200's torch)
    optional = names(r for key, reqs in extras.items() if key != "test" for r in reqs) - names(project["dependencies"])

    paths = [*(ROOT / "simpletuner").rglob("*.py"), *(SCRIPTS / name for name in TRUTH_SCRIPTS)]
    local = {p.stem for p in SCRIPTS.glob("*.py")} | {"simpletuner"}
    imported = set().union(*(_imports(p) for p in paths)) - set(sys.stdlib_module_names) - local
    needed = {_norm(DISTRIBUTIONS.get(name, name)) for name in imported} - optional
    assert {"pydantic", "diffusers", "orjson", "torch"} <= needed  # the scan sees what it should
    missing = needed - image
    assert missing <= carried, f"add to scripts/gpu_wheels.sh: {sorted(missing - carried)}"
    # nothing the image has travels, except typing-extensions (pydantic needs a newer one; installed only
    # where the image's is older)
    assert carried & image <= {"typing-extensions"}
    assert all(re.fullmatch(r"\d+(\.\d+)+", version) for version in wheels.values())  # exact pins


def test_bench_mfu_puts_the_checkout_before_the_callers_pythonpath():
    bench_mfu = _load("bench_mfu")
    env = bench_mfu.child_env({"PYTHONPATH": "/tmp/site", "HOME": "/root"})
    assert env["PYTHONPATH"] == f"{ROOT}{os.pathsep}/tmp/site" and env["HOME"] == "/root"
    assert bench_mfu.child_env({})["PYTHONPATH"] == str(ROOT)
