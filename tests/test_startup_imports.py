"""A run imports only what it uses: one step of a tiny SD LoRA (local folder, plain AdamW, no validation prompt,
``report_to: none``) in a fresh interpreter leaves no tracker, quantisation, LyCORIS, video-decoding or
object-store library, no other model family and none of the machinery the config does not ask for in
``sys.modules``. The runs that do use them import them where they are used (their own tests cover them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_RUN = r"""
import json, sys
from simpletuner.cli import main
code = main(["train", "--config", sys.argv[1]])
print("MODULES " + json.dumps(sorted(sys.modules)))
sys.exit(code)
"""

#: Not imported by this run, each with why it is not needed. (boto3 / botocore are: accelerate imports them
#: itself, through accelerate.utils.other -> accelerate.commands.config.sagemaker, which we cannot change.)
NOT_NEEDED = {
    # trackers: report_to is "none"
    "tensorboard": "report_to none",
    "torch.utils.tensorboard": "report_to none",
    "wandb": "report_to none",
    # quantisation: base_model_precision is the default (no quantised base)
    "optimum.quanto": "no quantised base",
    "torchao": "no quantised base (models.library_probes hides it from the libraries' probes)",
    "bitsandbytes": "no quantised base",
    # LyCORIS: lora_type is standard (peft)
    "lycoris": "lora_type standard",
    "simpletuner.models.adapters.lycoris": "lora_type standard",
    # video decoding and writing: an image dataset, no validation videos
    "av": "image dataset",
    "imageio": "image dataset",
    "cv2": "image dataset",
    "decord": "image dataset",
    "moviepy": "no validation videos",
    # object stores: a local dataset
    "s3fs": "local dataset",
    "aiobotocore": "local dataset",
    "simpletuner.data_backend.object_store": "local dataset",
    "simpletuner.data_backend.store_failures": "local dataset",
    # GH200 pieces the config does not enable
    "simpletuner.gh200.managed_weights": "managed_memory off and no validation",
    "simpletuner.gh200.ramp": "enable_batch_size_rampup off",
    "simpletuner.gh200.diagnostic": "not a diagnostic run",
    # optimizers the config does not name: it uses torch's AdamW
    "simpletuner.training.optimizers.adamw_bf16": "optimizer adamw",
    "simpletuner.training.optimizers.automagic": "optimizer adamw",
    "simpletuner.training.optimizers.prodigy": "optimizer adamw",
    "simpletuner.training.optimizers.rounding": "optimizer adamw",
    "simpletuner.training.optimizers.optimi": "optimizer adamw",
    "simpletuner.training.optimizers.bnb": "optimizer adamw",
    "optimi": "optimizer adamw",
    # validation: no validation prompt, no eval_steps
    "simpletuner.training.validation": "no validation prompt or eval_steps",
    "simpletuner.training.offload": "no validation (low_vram offloads the validation models)",
    # the memory planner: only an out-of-memory error asks it what would fit
    "simpletuner.memory.oom": "no OOM",
    "simpletuner.memory.autoconfig": "a CPU run: no GPU estimate (the pre-flight reads weight sizes from headers)",
    "simpletuner.memory.estimate_store": "a CPU run: no GPU estimate",
    # model families not in use: model_family is sd
    "simpletuner.models.sdxl": "model_family sd",
    "simpletuner.models.sd3": "model_family sd",
    "simpletuner.models.flux": "model_family sd",
    "simpletuner.models.flux_kontext": "model_family sd",
    "simpletuner.models.edit_pairs": "model_family sd (edit models only)",
    "simpletuner.models.flow": "model_family sd (flow matching families only)",
    "simpletuner.models.packed": "model_family sd (packed-latent families only)",
    "simpletuner.models.wan": "model_family sd",
    "simpletuner.models.wan22": "model_family sd",
    "simpletuner.models.wan22_i2v": "model_family sd",
    "simpletuner.models.wan22_ti2v": "model_family sd",
    "simpletuner.models.qwen_image": "model_family sd",
    "simpletuner.models.qwen_image_edit": "model_family sd",
}


@pytest.mark.slow
def test_a_plain_lora_run_imports_only_what_it_uses(make_config, tmp_path):
    raw = make_config(max_train_steps=1, training_type="lora", optimizer="adamw", report_to="none")
    assert "validation_prompt" not in raw and "eval_steps" not in raw
    config = tmp_path / "config.json"
    config.write_text(json.dumps(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, str(config)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (Path(raw["output_dir"]) / "pytorch_lora_weights.safetensors").is_file()  # it did train
    line = next(line for line in proc.stdout.splitlines() if line.startswith("MODULES "))
    loaded = set(json.loads(line.removeprefix("MODULES ")))
    # what this run does use is there (so the absences below are not those of a run that never started)
    assert {"simpletuner.models.sd", "simpletuner.models.adapters.peft_lora", "peft", "diffusers"} <= loaded
    present = {name: why for name, why in NOT_NEEDED.items() if name in loaded}
    assert not present, present
