"""Inputs that once crashed the program (found by config fuzzing), each now a clear error or a working run.

Each goes through the real entry point a user types: ``simpletuner train`` (``train.main``) or
``simpletuner estimate`` (``cli.main``), and must end with its exit code and a message naming the
key and the fix, never a traceback. The quantised-int8 case crashed the process itself
(SIGSEGV), so it runs in a child process.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simpletuner.cli import main as cli_main
from simpletuner.cli.train import main as train_main
from simpletuner.configuration import load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _console_logging_released():
    """``train.main`` points the console log at this test's captured stderr; drop it afterwards, so
    a later log line never meets a closed stream."""
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if type(h).__name__ == "_ConsoleHandler"]:
        root.removeHandler(handler)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """``kind -> folder`` of tiny zoo pipelines (written once for the module, on demand)."""
    from simpletuner.testing.zoo import write_tiny_model

    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = write_tiny_model(kind, tmp_path_factory.mktemp(f"crashers_{kind}") / "model")
        return made[kind]

    return get


def _config(tmp_path: Path, model: Path, data: Path, family: str, **overrides) -> Path:
    raw = {
        "pretrained_model_name_or_path": str(model),
        "model_family": family,
        "output_dir": str(tmp_path / "out"),
        "resolution": 64,
        "aspect_bucket_alignment": 16,
        "train_batch_size": 2,
        "max_train_steps": 1,
        "learning_rate": 1e-3,
        "seed": 1,
        "cache_config": {"cache_dir": str(tmp_path / "cache")},
        "datasets": [{"id": "shapes", "type": "local", "instance_data_dir": str(data)}],
    }
    raw.update(overrides)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def _train(capsys, config: Path, *sets: str) -> tuple[int, str]:
    argv = ["--config", str(config)]
    for item in sets:
        argv += ["--set", item]
    code = train_main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def _estimate(capsys, config: Path, *sets: str) -> tuple[int, str]:
    argv = ["estimate", "--config", str(config)]
    for item in sets:
        argv += ["--set", item]
    code = cli_main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def _nothing_written(tmp_path: Path) -> bool:
    return not (tmp_path / "cache").exists() and not (tmp_path / "out" / "validation").exists()


# --- resolution ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "setting, message",
    [
        ("resolution=1000000000000", "resolution: must be <= 16384, got 1000000000000"),
        (
            'datasets=[{"id": "s", "type": "local", "instance_data_dir": "DATA", "resolution": 1000000000000}]',
            "datasets[0].resolution: must be <= 16384",
        ),
        (
            'datasets=[{"id": "s", "type": "local", "instance_data_dir": "DATA", "resolution": 1}]',
            "datasets[0].resolution 1 is not a multiple of `aspect_bucket_alignment` 16 (bucket sides are, so it would "
            "train at another size): use 16",
        ),
        (
            'datasets=[{"id": "s", "type": "local", "instance_data_dir": "DATA", "resolution": 40}]',
            "datasets[0].resolution 40 is not a multiple of `aspect_bucket_alignment` 16",
        ),
    ],
)
def test_resolutions_no_run_can_use_are_refused(tiny_sd, shapes_dir, tmp_path, capsys, setting, message):
    """1e12 overflowed in the resize after the scan; a dataset's resolution 1 trained at 16x16 silently."""
    config = _config(tmp_path, tiny_sd, shapes_dir, "sd")
    setting = setting.replace("DATA", str(shapes_dir))
    code, err = _train(capsys, config, setting)
    assert code == 2 and message in err, err
    assert _nothing_written(tmp_path)
    code, err = _estimate(capsys, config, setting)
    assert code == 2 and message in err, err


# --- latent grid --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family, alignment, message",
    [
        (
            "sd3",
            8,
            "aspect_bucket_alignment 8 does not fit model_family 'sd3': the VAE encodes 8x8 pixels per latent and "
            "the sd3 denoiser takes 2x2 latents per token, so bucket sides must be multiples of 16 (16, 32, 48, "
            "64, ...); use 16",
        ),
        ("wan", 24, "bucket sides must be multiples of 16 (16, 32, 48, 64, ...); use 16 or 32"),
        ("flux", 40, "use 32 or 48"),
        (
            "sd",
            12,
            "aspect_bucket_alignment 12 does not fit model_family 'sd': the VAE encodes 8x8 pixels per latent, "
            "so bucket sides must be multiples of 8 (8, 16, 24, 32, ...); use 8 or 16",
        ),
    ],
)
def test_an_alignment_that_splits_latent_patches_is_refused_before_loading(
    tiny_models, shapes_dir, tmp_path, capsys, family, alignment, message
):
    """sd3 / wan buckets with odd latent sides failed with a shape mismatch after the whole cache fill."""
    config = _config(
        tmp_path, tiny_models(family), shapes_dir, family, resolution=alignment * 4, aspect_bucket_alignment=alignment
    )
    code, err = _train(capsys, config)
    assert code == 2 and message in err, err
    assert _nothing_written(tmp_path)
    assert _estimate(capsys, config)[0] == 2


def test_a_folder_with_other_factors_is_checked_against_its_own_configs(tiny_models, shapes_dir, tmp_path, capsys):
    """The config rule knows each family's usual VAE factor; a folder whose VAE downsamples 16x
    (as Wan 2.2 5B's does) needs buckets in multiples of 32 for 2x2 patches, refused before it loads."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_models("sd3"), model)
    vae = json.loads((model / "vae" / "config.json").read_text())
    vae["block_out_channels"] = [8, 8, 16, 16, 16]
    (model / "vae" / "config.json").write_text(json.dumps(vae))
    config = _config(tmp_path, model, shapes_dir, "sd3", resolution=48, aspect_bucket_alignment=16)
    code, err = _train(capsys, config)
    assert code == 2, err
    assert (
        f"aspect_bucket_alignment 16 does not fit model_family 'sd3': the VAE of {model} encodes 16x16 pixels per "
        "latent and the sd3 denoiser takes 2x2 latents per token, so bucket sides must be multiples of 32"
    ) in err
    assert _nothing_written(tmp_path)


def test_the_config_rule_and_the_model_specs_agree_on_every_family(tiny_models):
    """The family table the config checks (no folder read) is what each spec reads from a folder."""
    from simpletuner.configuration import validate_config
    from simpletuner.configuration.rules import FAMILY_LATENT_GRID
    from simpletuner.models import get_model_spec

    for kind in ("sd", "sdxl", "sd3", "flux", "wan", "wan22"):
        model = tiny_models(kind)
        family = "wan" if kind == "wan22" else kind
        raw = {
            "pretrained_model_name_or_path": str(model),
            "model_family": family,
            "resolution": 64,
            "aspect_bucket_alignment": 16,
            "max_train_steps": 1,
            "datasets": [{"id": "d", "type": "local", "instance_data_dir": "unused"}],
        }
        spec = get_model_spec(validate_config(raw, check_files=False))
        assert (spec.vae_scale_from_folder(), spec.latent_patch_from_folder()) == FAMILY_LATENT_GRID[family], kind


# --- names the run turns into files --------------------------------------------------------------------
LONG_NAME = "n" * 256  # one byte over the 255 of ext4, xfs, btrfs, tmpfs


@pytest.mark.parametrize(
    "key, where",
    [
        (
            "output_dir",
            "output_dir: the name 'nnnnnnnnnnnnnnnnnnnn...nnnnnnnnnnnn' is 256 bytes long, and the filesystem "
            "allows 255 bytes for one file or folder name: shorten it",
        ),
        ("cache_config.cache_dir", "cache_config.cache_dir: the name"),
        ("resume_from_checkpoint", "resume_from_checkpoint: the name"),
        ("validation_prompts", "validation_prompts: prompt file: the name"),
        ("data_backend_config", "data_backend_config"),
        (
            "tracker_project_name",
            "tracker_project_name: 'nnnnnnnnnnnnnnnnnnnn...nnnnnnnnnnnn' is 256 bytes long, and a "
            "folder name may have at most 255 bytes on most filesystems: shorten it",
        ),
        ("datasets", "datasets[0].instance_data_dir: the name"),
    ],
)
def test_a_name_over_the_filesystem_limit_is_a_config_error(tiny_sd, shapes_dir, tmp_path, capsys, key, where):
    """Each crashed with ``OSError: [Errno 36] File name too long`` (the tracker's at its first log)."""
    config = _config(tmp_path, tiny_sd, shapes_dir, "sd")
    if key == "datasets":
        value = json.dumps([{"id": "s", "type": "local", "instance_data_dir": str(tmp_path / LONG_NAME / "data")}])
    elif key == "tracker_project_name":
        value = LONG_NAME
    else:
        value = str(tmp_path / LONG_NAME / "x")
    code, err = _train(capsys, config, f"{key}={value}")
    assert code == 2 and where in err, err
    assert _nothing_written(tmp_path)
    assert _estimate(capsys, config, f"{key}={value}")[0] == 2


def test_a_tracker_name_must_be_one_folder_name(tiny_sd, shapes_dir, tmp_path, capsys):
    """It becomes a folder under output_dir/logs: a '/' would put the logs elsewhere."""
    code, err = _train(capsys, _config(tmp_path, tiny_sd, shapes_dir, "sd"), "tracker_project_name=../../elsewhere")
    assert code == 2 and "tracker_project_name: '../../elsewhere' is not one folder name" in err, err


# --- numbers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "setting, message",
    [
        ("learning_rate=1e308", "learning_rate: must be <= 1.0, got 1e+308"),
        ("adam_epsilon=1e400", "adam_epsilon: input should be a finite number (got '1e400')"),
        ('adam_epsilon="1e400"', "adam_epsilon: input should be a finite number (got '1e400')"),
        ('max_grad_norm="nan"', "max_grad_norm: input should be a finite number (got 'nan')"),
        ('flow_shift="inf"', "flow_shift: input should be a finite number (got 'inf')"),
        ("mode_scale=3", "mode_scale: must be <= 1.75, got 3"),
        ("seed=-1", "seed: must be >= 0, got -1"),
    ],
)
def test_non_finite_and_absurd_numbers_are_refused(tiny_sd, shapes_dir, tmp_path, capsys, setting, message):
    code, err = _train(capsys, _config(tmp_path, tiny_sd, shapes_dir, "sd"), setting)
    assert code == 2 and message in err, err


# --- int8 weights under bf16 on CPU ---------------------------------------------------------------------
_CHILD = """
import sys
import torch
from torch import nn
from simpletuner.models.adapters.quantize import quantize_base

# The product first: in_features 24 and 40 (not multiples of 16) and a non-contiguous input.
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 32), nn.Linear(32, 8)).to(torch.bfloat16).requires_grad_(False)
reference = [(m.weight.float(), m.bias.float()) for m in model]
assert quantize_base(model, "qint8") == 3
x = torch.randn(5, 3, 24, dtype=torch.bfloat16).transpose(0, 1)
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = model(x)
expected = x.float()
for weight, bias in reference:
    expected = expected @ weight.t() + bias
assert out.shape == (3, 5, 8) and torch.allclose(out.float(), expected, rtol=0.1, atol=0.1), (out, expected)

from simpletuner.cli.train import main
sys.exit(main(["--config", sys.argv[1], "--log-level", "WARNING"]))
"""


@pytest.mark.slow
def test_qint8_base_trains_under_bf16_on_cpu(tiny_models, shapes_dir, tmp_path):
    """torch's CPU int8 kernel, which optimum-quanto uses for bf16 inputs, segfaulted for layers whose
    in_features is not a multiple of 16 (the tiny wan's 24; reached first from the FLOP-count pass)
    and refused inputs not contiguous in their last dimension (SDXL's linear projections); qint8
    layers now hand it only what it handles, and compute the rest by quanto's dequantising matmul.
    The child checks that product against the unquantised one, then trains the tiny wan; a child,
    so a regression fails this test instead of killing the suite."""
    pytest.importorskip("optimum.quanto")
    config = _config(
        tmp_path,
        tiny_models("wan"),
        shapes_dir,
        "wan",
        base_model_precision="qint8",
        mixed_precision="bf16",
        lora_rank=4,
        max_train_steps=1,
        resolution=32,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(config)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert (tmp_path / "out" / "pytorch_lora_weights.safetensors").is_file()


# --- validation images ----------------------------------------------------------------------------------
def test_a_validation_image_that_fails_to_write_leaves_no_file(make_config, tmp_path, capsys, monkeypatch):
    """A full disk during a validation PNG left a 0-byte step_N.png (PIL buffers a small image whole
    and fails on close); now the image is written to a temp name and renamed, and the run stops
    with the space message (exit 5)."""
    raw = make_config(validation_prompt="a red square", validation_num_inference_steps=1, max_train_steps=1)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(raw))
    monkeypatch.setenv("SIMPLETUNER_FAULT_ENOSPC", "validation_image")
    code, err = _train(capsys, config)
    assert code == 5 and "not enough disk space for validation image step_000000_0.png" in err, err
    folder = Path(raw["output_dir"]) / "validation"
    assert folder.is_dir() and list(folder.iterdir()) == []


# --- position limits ----------------------------------------------------------------------------------
def test_the_position_limit_checks_the_sizes_the_datasets_train_at(tiny_models, shapes_dir, tmp_path, capsys):
    """The tiny sd3 has positions for 16 tokens a side (256 px). Where every dataset sets its own resolution and the
    run-wide one is unset (an ai-toolkit resolution list), the run-wide one is the largest of theirs, not 512."""
    config = _config(tmp_path, tiny_models("sd3"), shapes_dir, "sd3")
    raw = json.loads(config.read_text())
    del raw["resolution"]
    raw["datasets"] = [
        {"id": f"s{r}", "type": "local", "instance_data_dir": str(shapes_dir), "resolution": r} for r in (32, 64)
    ]
    config.write_text(json.dumps(raw))
    assert load_config(config).config.resolution == 64
    code, err = _estimate(capsys, config)
    assert code == 0, err
    large = json.dumps([*raw["datasets"][:1], {**raw["datasets"][1], "resolution": 512}])
    code, err = _estimate(capsys, config, f"datasets={large}")
    assert code == 2 and "datasets[1].resolution 512 needs 32 tokens along a side" in err and "at most 256" in err
    one = json.dumps([{"id": "s", "type": "local", "instance_data_dir": str(shapes_dir)}])
    code, err = _estimate(capsys, config, "resolution=512", f"datasets={one}")  # the run-wide size is the dataset's
    assert code == 2 and "resolution 512 needs 32 tokens along a side" in err, err
