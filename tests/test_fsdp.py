"""FSDP2 through `accelerate launch --config_file` with the shipped FSDP config, two processes on CPU.

Accelerate sets FSDP up only on GPUs; torch's FSDP2 runs on gloo, and the trainer switches
Accelerate's CPU state to FSDP (training/sharded_state.py), so these runs take the same path a GPU
node takes. Two launches: one uninterrupted full fine-tune (checkpoints at steps 2 and 4), and a
resume from its step-2 checkpoint that must end with the same weights bit for bit.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
import torch
import yaml
from safetensors.torch import load_file
from training_helpers import same_weights, tiny_config

from simpletuner.training import sharded_state

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "config" / "accelerate_config_gh200_fsdp.yaml"
ENV = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_variant(path: Path) -> Path:
    """The shipped FSDP config with what only a CPU box changes: 2 processes, no GPUs, fp32."""
    cfg = yaml.safe_load(SHIPPED.read_text())
    cfg.pop("gpu_ids")
    cfg.update(num_processes=2, use_cpu=True, mixed_precision="no")
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(accelerate_config: Path, raw: dict, path: Path) -> subprocess.CompletedProcess:
    path.write_bytes(orjson.dumps(raw))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config)]
    cmd += ["--main_process_port", str(_free_port()), str(ROOT / "simpletuner" / "train.py"), "--config", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)


def _unet(path: Path):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(path)


@pytest.fixture(scope="module")
def straight(tiny_sd, shapes_dir, tmp_path_factory):
    """One uninterrupted FSDP full fine-tune of STEPS steps, checkpoints every 2: ``(raw, yaml, proc)``."""
    root = tmp_path_factory.mktemp("fsdp")
    accelerate_config = _cpu_variant(root / "fsdp_cpu.yaml")
    raw = tiny_config(tiny_sd, shapes_dir, root, training_type="full", max_train_steps=STEPS, checkpointing_steps=2)
    proc = _launch(accelerate_config, raw, root / "straight.json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return raw, accelerate_config, proc


@pytest.mark.slow
def test_fsdp_checkpoint_is_sharded_per_rank_and_final_weights_load_in_diffusers(straight, tiny_sd):
    raw, _, proc = straight
    assert "switched its state to FSDP" in proc.stderr
    out = Path(raw["output_dir"])
    ckpt = out / f"checkpoint-{STEPS}"
    # One shard file per rank, plus the index; the whole-model files only name the shards.
    assert sorted(p.name for p in (ckpt / sharded_state.SHARDS).iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert load_file(ckpt / "trainable.safetensors") == {}
    assert orjson.loads((ckpt / "trainer_state.json").read_bytes())["world_size"] == 2
    manifest = orjson.loads((ckpt / "COMPLETE").read_bytes())["files"]
    assert {"shards/__0_0.distcp", "shards/__1_0.distcp", "shards/.metadata"} <= set(manifest)

    # The final diffusers folder holds the trained weights: the ones the step-4 shards hold, read on
    # one process into the base UNet (independent of the final save's gather), and not the base's.
    final = _unet(out / "unet").state_dict()
    base = _unet(tiny_sd / "unet")
    untrained = {k: v.clone() for k, v in base.state_dict().items()}
    from_shards = sharded_state.load_checkpoint_weights(ckpt, base).state_dict()
    assert same_weights(final, from_shards)
    assert not same_weights(final, untrained)
    assert all(torch.isfinite(t).all() for t in final.values())


@pytest.mark.slow
def test_fsdp_resume_from_a_sharded_checkpoint_ends_with_the_same_weights(straight, tmp_path):
    """Steps 3-4 resumed from the sharded step-2 checkpoint (in a fresh output_dir) give the
    uninterrupted run's final weights bit for bit: model, optimizer, RNG and sampler came back."""
    raw, accelerate_config, _ = straight
    out = tmp_path / "output"
    out.mkdir()
    shutil.copytree(Path(raw["output_dir"]) / "checkpoint-2", out / "checkpoint-2")
    resumed = dict(raw, output_dir=str(out), resume_from_checkpoint=str(out / "checkpoint-2"))
    proc = _launch(accelerate_config, resumed, tmp_path / "resumed.json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in proc.stderr
    want = _unet(Path(raw["output_dir"]) / "unet").state_dict()
    assert same_weights(_unet(out / "unet").state_dict(), want)


def _config(**overrides):
    base = dict(training_type="full", use_ema=False, validation_prompt_list=[], low_vram=False, optimizer="adamw")
    return SimpleNamespace(**{**base, **overrides})


def test_fsdp_refuses_what_it_cannot_train_before_anything_loads():
    from accelerate.utils import DistributedType

    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP)
    sharded_state.check_fsdp_run(_config(), fsdp)  # a full fine-tune passes
    sharded_state.check_fsdp_run(_config(training_type="lora"), SimpleNamespace(distributed_type="MULTI_GPU"))
    with pytest.raises(ValueError) as err:
        sharded_state.check_fsdp_run(_config(training_type="lora", use_ema=True, validation_prompt_list=["a"]), fsdp)
    text = str(err.value)
    assert "training_type 'lora'" in text and "accelerate_config_gh200.yaml" in text
    assert "use_ema" in text and "validation prompts" in text
    with pytest.raises(ValueError, match="optimizer 'bnb-adamw8bit': its state is kept per whole parameter"):
        sharded_state.check_fsdp_run(_config(optimizer="bnb-adamw8bit"), fsdp)


def test_fsdp_version_1_and_deepspeed_are_refused():
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        sharded_state.enable_fsdp(SimpleNamespace(), env={"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})
    with pytest.raises(ValueError, match="does not support"):
        sharded_state.refuse_deepspeed({"ACCELERATE_USE_DEEPSPEED": "true"})
    sharded_state.refuse_deepspeed({})
    assert sharded_state.fsdp_requested({"ACCELERATE_USE_FSDP": "true"})
    assert not sharded_state.fsdp_requested({})
