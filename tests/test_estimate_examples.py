"""`simpletuner estimate` on every example config, in every precision the schema allows.

The examples name model folders of real checkpoints (/models/FLUX.1-dev, ...) that a test machine
does not have. The estimate reads configs only (the denoiser is built on ``meta``), so each example
runs against a config-only folder of its family: the zoo's tiny model with its weights deleted.
Everything else — resolution, micro-batch, adapter, optimizer, checkpointing, datasets — is the
example's own; only ``pretrained_model_name_or_path`` and ``mixed_precision`` are overridden, with
``--set`` as a user would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest
import torch

from simpletuner.cli import main
from simpletuner.configuration.schema import TrainingConfig
from simpletuner.memory.estimator import CUDA_CONTEXT_BYTES, GiB, autocast_forward

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "config" / "examples").glob("*.json"))
PRECISIONS = [p for p in get_args(TrainingConfig.model_fields["mixed_precision"].annotation) if isinstance(p, str)]
WEIGHT_DTYPE = {"no": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: SD 3.5 Medium's position-embedding size (patches per side); the tiny SD3 has 16, too few for 1024 px.
SD35_POS_EMBED_MAX_SIZE = 384


def _zoo_kind(raw: dict) -> str:
    """The tiny model standing in for an example's checkpoint: Wan 2.2 folders hold two experts."""
    if raw["model_family"] == "wan" and "Wan2.2" in raw["pretrained_model_name_or_path"]:
        return "wan22"
    return raw["model_family"]


@pytest.fixture(scope="session")
def config_only_model(tmp_path_factory):
    """``kind -> folder``: a tiny zoo pipeline of that kind with no weights (written once per session)."""
    from simpletuner.testing.zoo import write_tiny_model

    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            folder = write_tiny_model(kind, tmp_path_factory.mktemp(f"config_only_{kind}") / "model")
            for weights in folder.rglob("*.safetensors"):
                weights.unlink()  # the estimate must not need them
            if kind == "sd3":
                path = folder / "transformer" / "config.json"
                config = json.loads(path.read_text())
                path.write_text(json.dumps({**config, "pos_embed_max_size": SD35_POS_EMBED_MAX_SIZE}))
            made[kind] = folder
        return made[kind]

    return get


def test_the_matrix_covers_the_examples_and_precisions():
    assert len(EXAMPLES) >= 10 and {"flux_lora.json", "wan22_dual_expert_lora.json"} <= {p.name for p in EXAMPLES}
    assert set(PRECISIONS) == {"no", "bf16", "fp16"}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_estimates_in_every_precision(example, precision, config_only_model, capsys):
    raw = json.loads(example.read_text())
    folder = config_only_model(_zoo_kind(raw))
    code = main(
        [
            "estimate",
            "--config",
            str(example),
            "--json",
            "--set",
            f"pretrained_model_name_or_path={folder}",
            "--set",
            f"mixed_precision={precision}",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, f"exit {code}: {err}"
    data = json.loads(out)
    est = data["estimate"]
    # The estimate is of the example as written, at the precision asked for.
    assert (est["model_family"], est["resolution"], est["micro_batch_size"], est["mixed_precision"]) == (
        raw["model_family"],
        raw["resolution"],
        raw["train_batch_size"],
        precision,
    )
    assert est["gradient_checkpointing"] == raw.get("gradient_checkpointing", False)
    lora = raw.get("training_type", "lora") == "lora"
    assert est["weight_dtype"] == (WEIGHT_DTYPE[precision] if lora else "float32")
    # A sane total: every part there, the parts add up, and a tiny model needs little beyond the CUDA context.
    assert min(est["weights"], est["gradients"], est["optimizer_state"], est["activations"], est["batch_data"]) > 0
    step_peak = est["activations"] + est["gradients"] + est["optimizer_transient"] + est["not_live_at_once"]
    assert est["total"] == (
        est["weights"] + est["optimizer_state"] + step_peak + est["batch_data"] + est["framework_overhead"]
    )
    assert data["total_bytes"] == est["total"] + sum(data["extras"].values())
    assert CUDA_CONTEXT_BYTES < data["total_bytes"] < 4 * GiB


def test_autocast_forward_is_the_model_itself_with_fp32_outputs():
    """What Accelerate does for mixed precision: the same object (specs read ``model.config``), its
    forward under autocast with fp32 outputs, and the class's forward back afterwards."""
    model = torch.nn.Linear(4, 4)
    model.config = {"guidance_embeds": False}
    with autocast_forward(model, "cpu", torch.bfloat16) as prepared:
        assert prepared is model and prepared.config == {"guidance_embeds": False}
        out = prepared(torch.ones(2, 4))
        assert out.dtype == torch.float32 and "forward" in vars(model)
    assert "forward" not in vars(model) and model(torch.ones(2, 4)).dtype == torch.float32
