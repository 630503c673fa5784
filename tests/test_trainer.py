"""The trainer end to end on the tiny SD model: saving, reloading, resuming, caching (LoRA learning
and its reload in diffusers, for every family: test_families.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import train

from simpletuner.training import checkpoint as ckpt


def test_resume_is_exact_across_epoch_boundary(make_config, tmp_path):
    # 12 images in 3 buckets of 4, batch 2, accumulation 2: 3 optimizer steps per epoch,
    # so stopping at step 4 resumes mid-way through the second epoch.
    common = dict(gradient_accumulation_steps=2, lr_scheduler="linear", lr_warmup_steps=2)
    straight_raw = make_config(max_train_steps=7, output_dir=str(tmp_path / "straight"), **common)
    straight, straight_result = train(straight_raw)

    out = str(tmp_path / "resumed")
    first, first_result = train(make_config(max_train_steps=7, output_dir=out, checkpointing_steps=4, **common))
    # Simulate a stop right after step 4's checkpoint: resume from it with the same config.
    assert ckpt.find_latest(tmp_path / "resumed").name == "checkpoint-7"  # the end is a checkpoint too
    latest = tmp_path / "resumed" / "checkpoint-4"
    resumed_raw = make_config(max_train_steps=7, output_dir=out, resume_from_checkpoint=str(latest), **common)
    resumed, resumed_result = train(resumed_raw)

    assert resumed_result.global_step == 7
    assert resumed_result.losses == pytest.approx(straight_result.losses[4:], rel=0, abs=0)
    want = load_file(straight_result.output_path)
    got = load_file(resumed_result.output_path)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert resumed.sampler.state_dict() == straight.sampler.state_dict()
    assert resumed.progress == straight.progress


def test_checkpoint_layout_latest_and_retention(make_config, tmp_path):
    out = tmp_path / "ck"
    train(make_config(max_train_steps=6, output_dir=str(out), checkpointing_steps=2, checkpoints_total_limit=2))
    names = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-4", "checkpoint-6"]
    assert (out / "latest").read_text() == "checkpoint-6"
    assert not list(out.glob(".checkpoint-*"))
    state = ckpt.read_trainer_state(out / "checkpoint-6")
    assert state["global_step"] == 6 and state["samples_seen"] == 12 and state["world_size"] == 1
    # An incomplete folder (no marker) is never chosen.
    (out / "checkpoint-8").mkdir()
    assert ckpt.find_latest(out).name == "checkpoint-6"
    (out / "latest").unlink()
    assert ckpt.find_latest(out).name == "checkpoint-6"


def test_resume_refuses_a_checkpoint_of_another_adapter(make_config, tmp_path):
    out = str(tmp_path / "rank")
    train(make_config(max_train_steps=2, output_dir=out, checkpointing_steps=2, lora_rank=4))
    with pytest.raises(ValueError, match="lora_rank: checkpoint has 4, config has 8"):
        train(make_config(max_train_steps=4, output_dir=out, resume_from_checkpoint="latest", lora_rank=8))


def test_caches_are_reused_and_invalidated(make_config, tmp_path):
    trainer, _ = train(make_config(max_train_steps=1))
    assert trainer.data.fill_reports["latents"].num_computed == 12
    trainer, _ = train(make_config(max_train_steps=1, output_dir=str(tmp_path / "o2")))
    assert trainer.data.fill_reports["latents"].num_computed == 0
    assert trainer.data.fill_reports["text"].num_computed == 0
    trainer, _ = train(make_config(max_train_steps=1, output_dir=str(tmp_path / "o3"), resolution=48))
    assert trainer.data.fill_reports["latents"].num_computed == 12
    assert trainer.data.fill_reports["text"].num_computed == 0


def test_validation_images_before_and_after(make_config, tmp_path):
    raw = make_config(
        max_train_steps=2, validation_prompt="a red circle", validation_num_inference_steps=2, num_validation_images=2
    )
    _, result = train(raw)
    names = sorted(p.name for p in result.validation_images)
    assert names == ["step_000000_0.png", "step_000000_1.png", "step_000002_0.png", "step_000002_1.png"]
    assert all(p.exists() for p in result.validation_images)


def test_full_finetune_and_v_prediction(make_config, tmp_path):
    from diffusers import UNet2DConditionModel

    _, result = train(
        make_config(
            max_train_steps=2,
            training_type="full",
            prediction_type="v_prediction",
            mixed_precision="bf16",
            gradient_checkpointing=True,
        )
    )
    unet = UNet2DConditionModel.from_pretrained(result.output_path)
    assert sum(p.numel() for p in unet.parameters()) > 0
    assert all(torch.isfinite(torch.tensor(result.losses)))


def test_bad_data_errors(make_config, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    raw = make_config()
    raw["datasets"][0]["instance_data_dir"] = str(empty)
    with pytest.raises(ValueError, match=f"no images found under {empty}"):
        train(raw)
    with pytest.raises(ValueError, match="train_batch_size 8"):
        train(make_config(train_batch_size=8))


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2"),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE=4"),
        ({"PMI_SIZE": "2"}, "PMI_SIZE=2"),
        ({"MASTER_ADDR": "127.0.0.1", "ACCELERATE_USE_CPU": "True"}, "starts ONE process"),
    ],
)
def test_launch_mismatches_are_caught(env, message):
    from simpletuner.training.launch import LaunchError, check_launch_matches

    with pytest.raises(LaunchError, match=message):
        check_launch_matches(1, env)
    check_launch_matches(1, {"ACCELERATE_USE_CPU": "True"})  # a plain single-process CPU launch
    check_launch_matches(2, {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "ACCELERATE_USE_CPU": "1"})


def test_tensorboard_receives_scalars_and_validation_images(make_config, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    train(
        make_config(
            max_train_steps=2,
            output_dir=str(out),
            report_to="tensorboard",
            validation_prompt="a red circle",
            validation_num_inference_steps=2,
        )
    )
    events = list((out / "logs").rglob("events.out.tfevents.*"))
    assert events, "no tensorboard event file written"
    acc = EventAccumulator(str(events[0].parent), size_guidance={"images": 0}).Reload()
    assert {"loss", "lr", "samples_per_s", "step_time_s"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [1, 2]
    assert acc.Tags()["images"], "validation images were not logged"


def test_image_with_good_header_but_cut_body_is_skipped_and_counted(make_config, tmp_path, shapes_dir):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(shapes_dir, data)
    victim = data / "000.png"  # a 64x64 image; keep its header, cut its pixel data
    victim.write_bytes(victim.read_bytes()[:120])
    raw = make_config(max_train_steps=1, max_bad_image_fraction=0.1)
    raw["datasets"][0]["instance_data_dir"] = str(data)
    trainer, result = train(raw)
    meta = trainer.state.get_dataset("shapes").metadata
    assert [p for p, _ in meta.bad_files] == ["000.png"]
    assert "cannot decode image" in meta.bad_files[0][1]
    assert all(s.path != "000.png" for s in meta.samples)
    assert result.global_step == 1

    raw = make_config(max_train_steps=1, max_bad_image_fraction=0.0, output_dir=str(tmp_path / "strict"))
    raw["datasets"][0]["instance_data_dir"] = str(data)
    with pytest.raises(ValueError, match="000.png"):
        train(raw)


def test_dora_adapter_trains_and_reloads_in_diffusers(make_config, tmp_path):
    from diffusers import StableDiffusionPipeline

    raw = make_config(max_train_steps=6, learning_rate=1e-2, lora_use_dora=True)
    trainer, result = train(raw)
    saved = load_file(result.output_path)
    assert any("lora_magnitude_vector" in k for k in saved), sorted(saved)[:5]
    pipe = StableDiffusionPipeline.from_pretrained(raw["pretrained_model_name_or_path"], safety_checker=None)
    pipe.load_lora_weights(str(result.output_path.parent))
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    gen = torch.Generator().manual_seed(1)
    x, t, ctx = torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([10, 500]), torch.randn(2, 77, 32, generator=gen)
    with torch.no_grad():
        assert torch.allclose(pipe.unet(x, t, ctx).sample, trained(x, t, ctx).sample, atol=1e-5)
