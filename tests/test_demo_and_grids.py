"""Validation with several prompts: the single images, one grid per validation step, the grid in TensorBoard.

(The demo's before | after picture and its cache re-use are tested with the demo in test_cli.py.)
"""

from __future__ import annotations

import orjson
import pytest
from PIL import Image, ImageChops

from simpletuner.configuration import ConfigError, load_config, validate_config
from simpletuner.state import StateTracker
from simpletuner.training.trainer import Trainer


def _same(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and ImageChops.difference(a.convert("RGB"), b.convert("RGB")).getbbox() is None


def test_prompt_file_trains_with_singles_and_a_grid_per_step_in_tensorboard(make_config, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "prompts.txt").write_text("a red circle\n\n  a blue square on a black background  \n")
    out = tmp_path / "out"
    raw = make_config(
        max_train_steps=1,
        output_dir=str(out),
        report_to="tensorboard",
        num_validation_images=2,
        validation_num_inference_steps=2,
        validation_prompts="prompts.txt",
    )
    (folder / "config.json").write_bytes(orjson.dumps(raw))
    monkeypatch.chdir(tmp_path)  # the prompt file is found next to the config, not in the working directory
    loaded = load_config(folder / "config.json")
    assert loaded.config.validation_prompt_list == ["a red circle", "a blue square on a black background"]

    result = Trainer(StateTracker(loaded.config, loaded.raw)).train()

    # Validation ran with no `validation_prompt` at all: at the start (step 0) and the end (step 1).
    validation = out / "validation"
    assert sorted(p.name for p in result.validation_images) == [
        f"step_00000{s}_{k}.png" for s in (0, 1) for k in range(4)
    ]
    for step in (0, 1):
        grid = Image.open(validation / f"step_{step:06d}_grid.png")
        assert grid.size == (2 * 64, 2 * 64)  # columns: num_validation_images; rows: prompts
        for k in range(4):  # image K = prompt * num_validation_images + i sits at row prompt, column i
            row, col = divmod(k, 2)
            tile = grid.crop((col * 64, row * 64, col * 64 + 64, row * 64 + 64))
            assert _same(tile, Image.open(validation / f"step_{step:06d}_{k}.png")), (step, k)
    first = Image.open(validation / "step_000000_grid.png")
    assert not _same(first.crop((0, 0, 64, 64)), first.crop((0, 64, 64, 128))), "the rows must follow their prompts"

    events = list((out / "logs").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events[0].parent), size_guidance={"images": 0}).Reload()
    logged = acc.Images("validation_grid")
    assert [e.step for e in logged] == [0, 1]
    assert all((e.width, e.height) == (128, 128) for e in logged)
    with Image.open(validation / "step_000001_grid.png") as want:
        import io

        assert _same(Image.open(io.BytesIO(logged[-1].encoded_image_string)), want)


def test_validation_prompts_merge_with_validation_prompt_and_bad_input_is_refused(make_config, tmp_path):
    both = validate_config(
        make_config(
            validation_prompt="a red circle",
            validation_steps=2,
            validation_prompts=["a green square", "a red circle", "a blue triangle"],
        )
    )
    assert both.validation_prompt_list == ["a red circle", "a green square", "a blue triangle"]
    only_list = validate_config(make_config(validation_prompts=["a green square"], validation_steps=2))
    assert only_list.validation_prompt_list == ["a green square"]
    assert validate_config(make_config()).validation_prompt_list == []

    def problems(**overrides) -> str:
        with pytest.raises(ConfigError) as info:
            validate_config(make_config(**overrides))
        return str(info.value)

    assert "`validation_steps` is set but `validation_prompt` is not (nor `validation_prompts`)" in problems(
        validation_steps=2
    )
    missing = tmp_path / "nope.txt"
    assert f"validation_prompts: prompt file {missing} does not exist" in problems(validation_prompts=str(missing))
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    assert f"prompt file {blank} holds no prompt" in problems(validation_prompts=str(blank))
    assert "validation_prompts: is an empty list" in problems(validation_prompts=[])
    assert "validation_prompts: item 1 ('') is not a prompt" in problems(validation_prompts=["a red circle", ""])
    assert "validation_prompts: expected a list of prompts or the path of a prompt file" in problems(
        validation_prompts=3
    )
