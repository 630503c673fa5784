"""SimpleTuner's Qwen-Image-Edit configs read by the dialect: `model_flavour: edit-v1` and the paired datasets of
its dataloader (an edited-image dataset naming a `dataset_type: conditioning` entry of source images).

The project below is this project's own reconstruction of the edit-v1 example in SimpleTuner's
documentation/quickstart/QWEN_EDIT.md (read at commit bc8e6ab of bghira/SimpleTuner): the config's keys that decide
what is trained, and its three dataloader entries (edited images, reference images, the conditioning-image-embeds
cache), with the paths replaced by temporary folders. Translation only: no model loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from simpletuner.configuration import load_config
from simpletuner.configuration.errors import ConfigError
from simpletuner.configuration.simpletuner import translate as dialect


def _edit_v1_datasets(reference_type: str = "reference_strict") -> list[dict]:
    return [
        {
            "id": "my-edited-images",
            "type": "local",
            "instance_data_dir": "datasets/edited-images",
            "caption_strategy": "textfile",
            "resolution": 1024,
            "conditioning_data": ["my-reference-images"],
            "conditioning_image_embeds": "my-reference-embeds",
            "cache_dir_vae": "cache/vae/edited-images",
        },
        {
            "id": "my-reference-images",
            "type": "local",
            "dataset_type": "conditioning",
            "instance_data_dir": "datasets/reference-images",
            "conditioning_type": reference_type,
            "resolution": 1024,
            "cache_dir_vae": "cache/vae/reference-images",
        },
        {
            "id": "my-reference-embeds",
            "type": "local",
            "dataset_type": "conditioning_image_embeds",
            "cache_dir": "cache/conditioning_image_embeds/reference",
        },
    ]


def _project(tmp_path: Path, datasets: list[dict], **config) -> tuple[Path, dict]:
    """A SimpleTuner working directory (models/, datasets/, config/); returns (its root, the config)."""
    root = tmp_path / "project"
    (root / "config").mkdir(parents=True)
    model = root / "models" / "qwen-image-edit"
    model.mkdir(parents=True)
    (model / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPipeline"}))
    for entry in datasets:
        if isinstance(entry.get("instance_data_dir"), str):
            (root / entry["instance_data_dir"]).mkdir(parents=True, exist_ok=True)
    (root / "config" / "multidatabackend.json").write_text(json.dumps(datasets))
    raw = {
        "model_type": "lora",
        "model_family": "qwen_image",
        "model_flavour": "edit-v1",
        "pretrained_model_name_or_path": "models/qwen-image-edit",
        "train_batch_size": 1,
        "gradient_accumulation_steps": 4,
        "validation_resolution": "1024x1024",
        "validation_guidance": 4.0,
        "validation_num_inference_steps": 30,
        "mixed_precision": "bf16",
        "gradient_checkpointing": True,
        "base_model_precision": "int8-quanto",
        "quantize_via": "cpu",
        "quantize_activations": False,
        "flow_schedule_shift": 1.73,
        "data_backend_config": "config/multidatabackend.json",
        "report_to": "none",
        **config,
    }
    (root / "config" / "config.json").write_text(json.dumps(raw))
    return root, raw


def _problems(raw: dict, root: Path) -> str:
    with pytest.raises(dialect.DialectError) as err:
        dialect.translate(raw, root / "config" / "config.json", root)
    return str(err.value)


def test_the_quickstart_edit_v1_example_becomes_one_dataset_with_its_source_folder(tmp_path, monkeypatch):
    root, raw = _project(tmp_path, _edit_v1_datasets())
    native, report = dialect.translate(raw, root / "config" / "config.json", root)
    (dataset,) = native["datasets"]  # the conditioning and embeds entries are not datasets here
    assert dataset["id"] == "my-edited-images"
    assert dataset["instance_data_dir"] == os.path.join(root, "datasets", "edited-images")
    assert dataset["conditioning_data_dir"] == os.path.join(root, "datasets", "reference-images")
    assert native["pretrained_model_name_or_path"] == os.path.join(root, "models", "qwen-image-edit")
    ignored = " ".join(report.ignored)
    assert "`datasets[0] (my-edited-images).conditioning_image_embeds`" in ignored
    assert "`datasets[2] (my-reference-embeds)`" in ignored
    assert "keyed by caption and source image" in ignored
    assert not report.approximated or all("conditioning" not in line for line in report.approximated)
    # the same run when `conditioning_data` is a string, as SimpleTuner also reads it
    datasets = _edit_v1_datasets()
    datasets[0]["conditioning_data"] = "my-reference-images"
    (root / "config" / "multidatabackend.json").write_text(json.dumps(datasets))
    again, _ = dialect.translate(raw, root / "config" / "config.json", root)
    assert again["datasets"] == native["datasets"]
    # the native schema takes the translation
    monkeypatch.chdir(root)
    config = load_config(root / "config" / "config.json", check_files=False).config
    assert config.datasets[0].conditioning_data_dir == os.path.join(root, "datasets", "reference-images")


def test_edit_v1_without_a_local_folder_is_its_hub_model(tmp_path):
    root, raw = _project(tmp_path, _edit_v1_datasets())
    del raw["pretrained_model_name_or_path"]
    native, _ = dialect.translate(raw, root / "config" / "config.json", root)
    assert native["pretrained_model_name_or_path"] == "Qwen/Qwen-Image-Edit"


@pytest.mark.parametrize("flavour", ["edit-v2", "edit-v2+", "edit-v3"])
def test_edit_plus_flavours_stop_saying_why(tmp_path, flavour):
    root, raw = _project(tmp_path, _edit_v1_datasets(), model_flavour=flavour)
    text = _problems(raw, root)
    assert f"`model_flavour`: {flavour!r}" in text
    assert "several source images per sample" in text and "`edit-v1`" in text


def test_reference_loose_is_approximated_with_a_warning(tmp_path):
    root, raw = _project(tmp_path, _edit_v1_datasets("reference_loose"))
    native, report = dialect.translate(raw, root / "config" / "config.json", root)
    assert native["datasets"][0]["conditioning_data_dir"] == os.path.join(root, "datasets", "reference-images")
    (warning,) = [line for line in report.approximated if "reference_loose" in line]
    assert "datasets[1] (my-reference-images)" in warning and "2%" in warning


def test_other_conditioning_types_stop(tmp_path):
    root, raw = _project(tmp_path, _edit_v1_datasets("canny"))
    text = _problems(raw, root)
    assert (
        "datasets[1] (my-reference-images): `conditioning_type: canny`: not a kind of conditioning trained here" in text
    )
    assert "reference_strict" in text


def test_controlnet_conditioning_without_controlnet_stops(tmp_path):
    root, raw = _project(tmp_path, _edit_v1_datasets("controlnet"))
    text = _problems(raw, root)
    assert "datasets[1] (my-reference-images): `conditioning_type: controlnet` names a ControlNet's" in text
    assert "set `controlnet: true`" in text


def test_two_conditioning_datasets_for_one_dataset_stop(tmp_path):
    datasets = _edit_v1_datasets()
    second = {**datasets[1], "id": "my-reference-images-b", "instance_data_dir": "datasets/reference-b"}
    datasets[0]["conditioning_data"] = ["my-reference-images", "my-reference-images-b"]
    root, raw = _project(tmp_path, [*datasets, second])
    text = _problems(raw, root)
    assert "datasets[0] (my-edited-images): `conditioning_data` names 2 conditioning datasets" in text
    assert "several source images per sample" in text


def test_a_conditioning_entry_no_dataset_names_stops_with_its_id(tmp_path):
    datasets = _edit_v1_datasets()
    stray = {**datasets[1], "id": "forgotten-sources", "instance_data_dir": "datasets/forgotten"}
    root, raw = _project(tmp_path, [*datasets, stray])
    text = _problems(raw, root)
    assert (
        "datasets[3] (forgotten-sources): a `dataset_type: conditioning` entry that no training dataset names" in text
    )
    assert "my-reference-images" not in text.split("forgotten-sources")[0]  # the paired entry is fine
    # a disabled one is left out, as SimpleTuner leaves it out
    (root / "config" / "multidatabackend.json").write_text(json.dumps([*datasets, {**stray, "disabled": True}]))
    native, _ = dialect.translate(raw, root / "config" / "config.json", root)
    assert [d["id"] for d in native["datasets"]] == ["my-edited-images"]


def test_a_name_that_is_no_conditioning_entry_stops(tmp_path):
    datasets = _edit_v1_datasets()
    datasets[0]["conditioning_data"] = "my-refrence-images"  # a typo
    root, raw = _project(tmp_path, datasets)
    text = _problems(raw, root)
    assert "`conditioning_data`: 'my-refrence-images' is not the `id`" in text and "'my-reference-images'" in text


def test_the_loader_reports_the_refusal_as_a_config_error(tmp_path, monkeypatch):
    root, _ = _project(tmp_path, _edit_v1_datasets("controlnet"))
    monkeypatch.chdir(root)
    with pytest.raises(ConfigError, match="but `controlnet` is not true"):
        load_config(root / "config" / "config.json", check_files=False)
