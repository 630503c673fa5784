"""The model card of a Hub upload (simpletuner/training/model_card.py): its metadata as huggingface_hub reads it,
what the text says, and the diffusers snippet, run for real against a Hub cache that holds the tiny base model and
the uploaded weights (offline, as the suite runs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hub_fixtures import copy_folder_to_hub_cache, folder_files, lay_out_hub_cache, use_hub_cache
from huggingface_hub import ModelCard
from training_helpers import LATENT_SHAPE, TOKENS, WIDTH

from simpletuner.configuration import validate_config
from simpletuner.configuration.families import FAMILIES, FAMILY_NAMES
from simpletuner.models import get_model_spec
from simpletuner.models.adapters import prepare_for_training
from simpletuner.training.model_card import (
    EXPERT_COMPONENTS,
    EXPERT_FILE,
    FAMILY_TAGS,
    VIDEO_FPS,
    CardFacts,
    call_arguments,
    model_card,
)

LORA_FILE = "pytorch_lora_weights.safetensors"
BASE_ID = "org/tiny-sd"
REPO_ID = "me/tiny-lora"
IMAGES = (("validation/step_000004_0.png", "a red square"), ("validation/step_000004_1.png", "a 'blue' circle: #2"))


def _facts(**overrides) -> CardFacts:
    fields = dict(repo_id=REPO_ID, base_model=BASE_ID, step=4, num_processes=1, weight_files=(LORA_FILE,))
    return CardFacts(**{**fields, **overrides})


def _hub_config(family: str = "sd", **overrides):
    """A config naming a Hub model (no folder is read), one local dataset."""
    data = Path(__file__).parent / "data"
    raw = {
        "pretrained_model_name_or_path": BASE_ID,
        "model_family": family,
        "max_train_steps": 4,
        "output_dir": "/tmp/simpletuner-card-test-output",
        "datasets": [{"id": "pics", "type": "local", "instance_data_dir": str(data)}],
        **overrides,
    }
    return validate_config(raw)


def _snippet(card: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    assert blocks, card
    return blocks[0]


# --- metadata -------------------------------------------------------------------------------------------------
def test_metadata_reads_back_through_huggingface_hub():
    config = _hub_config(
        validation_prompt="a red square",
        validation_prompts=["a 'blue' circle: #2"],
        datasets=[
            {"id": "pics", "type": "local", "instance_data_dir": str(Path(__file__).parent / "data")},
            {"id": "hub", "type": "huggingface", "dataset_name": "org/shapes"},
        ],
    )
    card = ModelCard(model_card(config, _facts(images=IMAGES, grid="validation/step_000004_grid.png")))
    data = card.data
    assert data.base_model == BASE_ID and data.base_model_relation == "adapter"
    assert data.library_name == "diffusers" and data.pipeline_tag == "text-to-image"
    assert data.datasets == ["org/shapes"]
    assert data.widget == [{"text": prompt, "output": {"url": path}} for path, prompt in IMAGES]
    assert card.text.lstrip().startswith(f"# {REPO_ID}")
    assert "<Gallery />" in card.text and "](validation/step_000004_grid.png)" in card.text


@pytest.mark.parametrize(
    "overrides, kind",
    [
        ({}, ["lora", "template:sd-lora"]),
        ({"lora_type": "lycoris"}, ["lycoris"]),
        ({"training_type": "full"}, ["full"]),
    ],
)
def test_tags_say_the_kind_of_weights(overrides, kind):
    tags = ModelCard(model_card(_hub_config(**overrides), _facts())).data.tags
    assert tags[:2] == ["diffusers", "simpletuner"]
    assert [t for t in tags if t in ("lora", "template:sd-lora", "lycoris", "full")] == kind


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tags_name_the_family_and_the_pipeline(family):
    tags = ModelCard(model_card(_hub_config(family), _facts())).data.tags
    assert FAMILY_TAGS[family] in tags
    want = "text-to-video" if FAMILIES[family].video else "text-to-image"
    assert want in tags and ModelCard(model_card(_hub_config(family), _facts())).data.pipeline_tag == want


def test_audience_tag_and_note():
    plain = model_card(_hub_config(), _facts())
    assert "not-for-all-audiences" in ModelCard(plain).data.tags and "**Note:**" not in plain
    safe = model_card(_hub_config(model_card_safe_for_work=True, model_card_note="Trained on *shapes*."), _facts())
    tags = ModelCard(safe).data.tags
    assert "safe-for-work" in tags and "not-for-all-audiences" not in tags
    assert "**Note:** Trained on *shapes*." in safe


def test_a_local_base_model_is_not_metadata():
    card = model_card(_hub_config(), _facts(base_model=None))
    data = ModelCard(card).data
    assert data.base_model is None and getattr(data, "base_model_relation", None) is None
    assert 'base = "PATH/TO/BASE-MODEL"' in _snippet(card)


# --- the text -------------------------------------------------------------------------------------------------
def test_settings_datasets_and_trigger_words_are_on_the_card():
    data = str(Path(__file__).parent / "data")
    config = _hub_config(
        validation_prompt="a `quoted` prompt",
        validation_guidance_scale=4.5,
        validation_num_inference_steps=12,
        validation_seed=7,
        validation_resolution="64,96x64",
        validation_negative_prompt="blurry",
        learning_rate=0.5,
        lr_scheduler="cosine",
        lr_warmup_steps=10,
        train_batch_size=2,
        gradient_accumulation_steps=3,
        mixed_precision="bf16",
        optimizer="prodigy",
        optimizer_config={"d_coef": 0.5},
        lora_rank=8,
        lora_alpha=4,
        lora_target_modules=["to_q", "to_v"],
        resolution=512,
        caption_dropout_probability=0.1,
        datasets=[
            {
                "id": "dogs",
                "type": "local",
                "instance_data_dir": data,
                "caption_strategy": "instance_prompt",
                "instance_prompt": "sks dog",
            },
            {"id": "rest", "type": "local", "instance_data_dir": data, "instance_prompt": "only a fallback"},
        ],
    )
    card = model_card(config, _facts(num_processes=2))
    for text in (
        "A LoRA of [org/tiny-sd](https://huggingface.co/org/tiny-sd)",
        "trained for 4 steps with simpletuner",
        "Instance prompt (trigger): `sks dog`",
        "- ``a `quoted` prompt``",
        "- Guidance scale: 4.5",
        "- Steps: 12",
        "- Seed: 7",
        "- Sizes: 64x64, 96x64",
        "- Negative prompt: `blurry`",
        "- Learning rate: 0.5, `cosine` schedule, 10 warm-up steps",
        "- Effective batch: 12 (micro-batch 2 x gradient accumulation 3 x 2 processes)",
        '- Optimizer: prodigy (`{"d_coef": 0.5}`)',
        "- Mixed precision: bf16",
        "- LoRA: rank 8, alpha 4",
        "- Targets: `to_q`, `to_v`",
        "- Resolution: 512",
        "- Caption dropout: 0.1",
        "- `dogs`: `local`, images, captions: `instance_prompt`, instance prompt `sks dog`",
        "instance prompt `only a fallback`",
        "torch_dtype=torch.bfloat16",
        'generator=torch.Generator("cpu").manual_seed(7)',
    ):
        assert text in card, text
    assert "`only a fallback`" not in card.split("## Validation")[0]  # a fallback caption is not a trigger


def test_lycoris_and_full_cards_describe_their_weights():
    lycoris = model_card(_hub_config(lora_type="lycoris", lycoris={"algo": "loha"}, lora_rank=4), _facts())
    assert "A LyCORIS LoHa adapter of" in lycoris and "- LyCORIS: loha, rank 4, alpha 4" in lycoris
    full = model_card(
        _hub_config(training_type="full"), _facts(weight_files=("unet/diffusion_pytorch_model.safetensors",))
    )
    assert "A full fine-tune of" in full and 'unet = AutoModel.from_pretrained(repo, subfolder="unet"' in full
    checkpoint = model_card(
        _hub_config(training_type="full"), _facts(weight_files=("trainable.safetensors",), checkpoint=True)
    )
    assert "```python" not in checkpoint and "resume_from_checkpoint" in checkpoint


def test_wan22_cards_name_the_experts_their_files_are_for():
    from simpletuner.models.wan import WanSpec
    from simpletuner.models.wan22 import EXPERTS, LORA_FILES

    assert EXPERT_COMPONENTS == EXPERTS and VIDEO_FPS == WanSpec.video_fps
    assert {stage: EXPERT_FILE.search(name).group(1) for stage, name in LORA_FILES.items()} == {
        "high": "high",
        "low": "low",
    }
    config = _hub_config("wan", validation_num_video_frames=5)
    both = model_card(config, _facts(weight_files=(LORA_FILES["high"], LORA_FILES["low"])))
    assert "the high-noise expert (`transformer`) and the low-noise expert (`transformer_2`)" in both
    snippet = _snippet(both)
    assert f'pipe.load_lora_weights(repo, weight_name="{LORA_FILES["high"]}", adapter_name="high")' in snippet
    assert (
        f'pipe.load_lora_weights(repo, weight_name="{LORA_FILES["low"]}", adapter_name="low", '
        "load_into_transformer_2=True)"
    ) in snippet
    assert "num_frames=5," in snippet and "export_to_video(frames" in snippet
    low = model_card(config, _facts(weight_files=(LORA_FILES["low"],)))
    assert "these weights are for the low-noise expert (`transformer_2`)." in low and 'adapter_name="high"' not in low
    one = model_card(_hub_config("wan"), _facts())  # Wan 2.1 / TI2V: one file, no experts
    assert "expert" not in one


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"validation_negative_prompt": "blurry", "validation_guidance_rescale": 0.7, "validation_resolution": "96x64"},
    ],
)
def test_the_snippet_calls_the_pipeline_as_validation_does(overrides):
    from simpletuner.training.validation import pipeline_arguments

    config = _hub_config(**overrides)
    width, height = config.validation_sizes[0]
    want = pipeline_arguments("sd", config, width, height)
    want.pop("num_images_per_prompt")
    assert call_arguments(config) == want


# --- the snippet runs -----------------------------------------------------------------------------------------
def _local_config(tiny_sd, tmp_path, **overrides):
    """The tiny SD folder trained at 64 px, validated in 1 step: the snippet renders at that size, in that step."""
    raw = {
        "pretrained_model_name_or_path": str(tiny_sd),
        "model_family": "sd",
        "max_train_steps": 4,
        "resolution": 64,
        "aspect_bucket_alignment": 16,
        "output_dir": str(tmp_path / "output"),
        "datasets": [{"id": "pics", "type": "local", "instance_data_dir": str(Path(__file__).parent / "data")}],
        "validation_prompt": "a red square",
        "validation_num_inference_steps": 1,
        "lora_rank": 4,
        **overrides,
    }
    return validate_config(raw)


def _trained_denoiser(config):
    """The tiny UNet with its adapter (or, for a full fine-tune, its weights) moved away from the base's."""
    spec = get_model_spec(config)
    model = prepare_for_training(spec.load_denoiser(torch.float32), spec.lora_targets, config, torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return spec, model.eval()


def _denoise(unet) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(1, *LATENT_SHAPE, generator=gen), torch.randn(1, TOKENS, WIDTH, generator=gen)
    with torch.no_grad():
        return unet(x, torch.tensor([500]), ctx).sample


def _run_card(monkeypatch, tmp_path, tiny_sd, config, facts: CardFacts, upload: Path) -> dict:
    """Put the tiny base (as BASE_ID) and ``upload`` with the card (as REPO_ID) into a Hub cache, then run the
    card's snippet as a user would, from an empty folder. Returns the snippet's variables."""
    cache = use_hub_cache(monkeypatch, tmp_path / "hub")
    copy_folder_to_hub_cache(cache, BASE_ID, tiny_sd)
    card = model_card(config, facts)
    readme = Path(upload, facts.folder, "README.md")
    readme.write_text(card, encoding="utf-8")
    lay_out_hub_cache(cache, REPO_ID, folder_files(upload))
    work = tmp_path / "user"
    work.mkdir()
    monkeypatch.chdir(work)
    scope: dict = {}
    exec(compile(_snippet(card), "model_card_snippet", "exec"), scope)
    assert (work / "output.png").is_file()
    return scope


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_lora_snippet_runs_and_loads_the_adapter(monkeypatch, tmp_path, tiny_sd, checkpoint):
    config = _local_config(tiny_sd, tmp_path)
    spec, trained = _trained_denoiser(config)
    upload = tmp_path / "upload"
    folder = upload / ("checkpoint-4" if checkpoint else "")
    assert spec.save_adapter(folder, trained) == folder / LORA_FILE
    facts = _facts(checkpoint=checkpoint)
    if checkpoint:  # the card says where the weights are: in the repo's checkpoint-4/
        assert 'subfolder="checkpoint-4"' in _snippet(model_card(config, facts))
    pipe = _run_card(monkeypatch, tmp_path, tiny_sd, config, facts, upload)["pipe"]
    base = get_model_spec(config).load_denoiser(torch.float32).eval()
    assert not torch.allclose(_denoise(pipe.unet), _denoise(base), atol=1e-4)  # the adapter changed the UNet
    assert torch.allclose(_denoise(pipe.unet), _denoise(trained), atol=1e-5)  # into the trained one


def test_the_lycoris_snippet_runs_and_merges_the_adapter(monkeypatch, tmp_path, tiny_sd):
    pytest.importorskip("lycoris", reason="the lycoris extra is not installed")
    config = _local_config(tiny_sd, tmp_path, lora_type="lycoris", lycoris={"algo": "locon"})
    spec, trained = _trained_denoiser(config)
    upload = tmp_path / "upload"
    spec.save_adapter(upload, trained)
    pipe = _run_card(monkeypatch, tmp_path, tiny_sd, config, _facts(), upload)["pipe"]
    base = get_model_spec(config).load_denoiser(torch.float32).eval()
    changed = [k for k, v in pipe.unet.state_dict().items() if not torch.equal(v, base.state_dict()[k])]
    assert changed and all(".attn" in k for k in changed)  # merged into the attention weights
    assert torch.allclose(_denoise(pipe.unet), _denoise(trained), atol=1e-4)


def test_the_full_fine_tune_snippet_runs_with_the_trained_unet(monkeypatch, tmp_path, tiny_sd):
    config = _local_config(tiny_sd, tmp_path, training_type="full")
    spec, trained = _trained_denoiser(config)
    upload = tmp_path / "upload"
    saved = spec.save_full(upload, trained)
    files = tuple(sorted(p.relative_to(upload).as_posix() for p in saved.rglob("*") if p.is_file()))
    pipe = _run_card(monkeypatch, tmp_path, tiny_sd, config, _facts(weight_files=files), upload)["pipe"]
    assert torch.equal(_denoise(pipe.unet), _denoise(trained))


def test_a_local_base_snippet_runs_once_its_path_is_filled_in(monkeypatch, tmp_path, tiny_sd):
    """The one line a user edits: the placeholder base path (here, the tiny folder)."""
    config = _local_config(tiny_sd, tmp_path)
    spec, trained = _trained_denoiser(config)
    upload = tmp_path / "upload"
    spec.save_adapter(upload, trained)
    cache = use_hub_cache(monkeypatch, tmp_path / "hub")
    facts = _facts(base_model=None)
    lay_out_hub_cache(cache, REPO_ID, folder_files(upload))
    snippet = _snippet(model_card(config, facts))
    placeholder = next(line for line in snippet.splitlines() if line.startswith("base = "))
    snippet = snippet.replace(placeholder, f"base = {str(tiny_sd)!r}")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(snippet, "model_card_snippet", "exec"), scope)
    assert torch.allclose(_denoise(scope["pipe"].unet), _denoise(trained), atol=1e-5)


def test_exported_copies_are_named_but_not_loaded_twice():
    """output_formats writes `<name>.comfyui.safetensors` beside the diffusers file: the card names it for the tools
    that load it, and the diffusers snippet loads the diffusers file once."""
    files = (LORA_FILE, "pytorch_lora_weights.comfyui.safetensors", "pytorch_lora_weights.kohya.safetensors")
    card = model_card(_hub_config(), _facts(weight_files=files))
    snippet = _snippet(card)
    assert snippet.count("load_lora_weights(") == 1 and f'weight_name="{LORA_FILE}"' in snippet
    assert "`pytorch_lora_weights.comfyui.safetensors` (comfyui)" in card
    assert "`pytorch_lora_weights.kohya.safetensors` (kohya)" in card
