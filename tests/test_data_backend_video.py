"""Video datasets: clips (frame folders, animated GIF/WebP, video files through PyAV) found and
probed by the metadata scan, frames taken every `frame_stride`, every frame cropped like an image,
cache keys that see the frame count, clear errors for short clips, and a Wan LoRA trained on clips.

Frame ``i`` of every clip written here is a flat grey of brightness ``10 * i`` (plus a pattern
where the crop matters), so the frames a sample took can be read back from the pixels."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from simpletuner.caching import latent_cache_key, sample_latent_key
from simpletuner.configuration import ConfigError, validate_config
from simpletuner.data_backend import (
    LocalDataBackend,
    RegisteredDataset,
    bucket_for,
    build_datasets,
    build_metadata,
    load_sample_pixels,
    prepare_image,
)
from simpletuner.data_backend.video import find_clips, natural_key, probe_clip

av = pytest.importorskip("av", reason="video files need the `video` extra (PyAV)")

SIZE = (48, 32)


def grey_frames(num: int, size=SIZE) -> list[Image.Image]:
    return [Image.new("RGB", size, (10 * i,) * 3) for i in range(num)]


def write_frame_folder(folder, num: int, size=SIZE, pattern: bool = False) -> None:
    """Frames named f1.png .. fN.png (no zero padding: a plain sort would put f10 before f2)."""
    folder.mkdir(parents=True)
    ys, xs = np.mgrid[0 : size[1], 0 : size[0]].astype(np.float32)
    ramp = (xs * 60 / size[0] + ys * 60 / size[1])[..., None]
    for i in range(num):
        array = np.full((size[1], size[0], 3), 10 * i, np.float32) + (ramp if pattern else 0)
        Image.fromarray(array.clip(0, 255).astype(np.uint8)).save(folder / f"f{i + 1}.png")


def write_animation(path, num: int, size=SIZE) -> None:
    frames = grey_frames(num, size)
    extra = {"lossless": True} if path.suffix == ".webp" else {}
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0, **extra)


def write_video(path, num: int, size=SIZE) -> None:
    """A real clip with PyAV: lossless H.264 where the wheel has libx264, else MPEG-4 part 2."""
    codec, options = ("libx264", {"crf": "0"}) if "libx264" in av.codecs_available else ("mpeg4", {"qscale": "1"})
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt, stream.options = size[0], size[1], "yuv420p", options
        for frame in grey_frames(num, size):
            for packet in stream.encode(av.VideoFrame.from_image(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def config_for(data_dir, num_frames=5, frame_stride=1, model_dir="/models/wan", **overrides):
    dataset = {
        "id": "clips",
        "type": "local",
        "instance_data_dir": str(data_dir),
        "dataset_type": "video",
        "num_frames": num_frames,
        "frame_stride": frame_stride,
        **overrides.pop("dataset", {}),
    }
    raw = {
        "pretrained_model_name_or_path": model_dir,
        "model_family": "wan",
        "output_dir": str(data_dir.parent / f"{data_dir.name}-out"),
        "resolution": 32,
        "aspect_bucket_alignment": 16,
        "max_train_steps": 1,
        "datasets": [dataset],
        **overrides,
    }
    return raw


def scan(data_dir, **kwargs):
    config = validate_config(config_for(data_dir, **kwargs), check_files=False)
    backend = LocalDataBackend(data_dir, "clips")
    metadata = build_metadata(backend, config.datasets[0], config, seed=config.seed)
    return RegisteredDataset("clips", config.datasets[0], backend, metadata)


def frame_levels(pixels: torch.Tensor) -> list[int]:
    """The brightness step (``10 * i``) each frame of ``[3, F, H, W]`` pixels shows."""
    means = (pixels + 1) * 127.5
    return [round(float(means[:, f].mean()) / 10) for f in range(pixels.shape[1])]


def test_every_clip_kind_is_found_counted_and_strided(tmp_path):
    write_frame_folder(tmp_path / "walk", 12)
    (tmp_path / "walk.txt").write_text("a person walking")
    write_animation(tmp_path / "spin.gif", 9)
    (tmp_path / "nested").mkdir()
    write_animation(tmp_path / "nested" / "wave.webp", 10)
    write_video(tmp_path / "pan.mp4", 11)
    write_video(tmp_path / "zoom.mkv", 9)  # Matroska records no frame count: packets are counted
    (tmp_path / "pan.txt").write_text("a slow pan")

    backend = LocalDataBackend(tmp_path, "clips")
    clips, bad, stray = find_clips(backend, {})
    assert not bad and not stray
    counts = {clip.display: probe_clip(backend, clip) for clip in clips}
    assert counts == {
        "walk/": (48, 32, 12),
        "spin.gif": (48, 32, 9),
        "nested/wave.webp": (48, 32, 10),
        "pan.mp4": (48, 32, 11),
        "zoom.mkv": (48, 32, 9),
    }
    walk = next(clip for clip in clips if clip.media == "frames")
    assert [os.path.basename(p) for p in walk.frames] == [f"f{i}.png" for i in range(1, 13)]
    assert sorted(["f10.png", "f2.png", "f1.png"], key=natural_key) == ["f1.png", "f2.png", "f10.png"]

    dataset = scan(tmp_path, num_frames=5, frame_stride=2)  # frames 0, 2, 4, 6, 8 of each clip
    samples = {s.path: s for s in dataset.samples}
    assert set(samples) == {"walk", "spin.gif", "nested/wave.webp", "pan.mp4", "zoom.mkv"}
    assert samples["walk"].caption == "a person walking" and samples["pan.mp4"].caption == "a slow pan"
    assert samples["spin.gif"].caption == "spin"  # no .txt: the file name
    assert samples["walk"].frame_paths == tuple(f"walk/f{i}.png" for i in (1, 3, 5, 7, 9))
    for sample in samples.values():
        assert (sample.num_frames, sample.frame_stride, sample.is_video) == (5, 2, True)
        assert sample.original_size == SIZE and sample.bucket == bucket_for(*SIZE, 32, 16)  # as an image's
        pixels, info = load_sample_pixels(dataset, sample)
        assert pixels.shape == (3, 5, sample.bucket[1], sample.bucket[0]) and pixels.dtype == torch.float32
        assert -1 <= float(pixels.min()) and float(pixels.max()) <= 1
        assert frame_levels(pixels) == [0, 2, 4, 6, 8], sample.path
        assert (info["num_frames"], info["frame_stride"]) == (5, 2)


def test_every_frame_is_cropped_like_an_image(tmp_path):
    write_frame_folder(tmp_path / "wide", 5, size=(90, 40), pattern=True)  # 2.25:1 into a 3:1 bucket
    dataset = scan(tmp_path, dataset={"crop_style": "random"}, seed=4)
    (sample,) = dataset.samples
    pixels, info = load_sample_pixels(dataset, sample)
    width, height = sample.bucket
    assert pixels.shape == (3, 5, height, width) and info["original_size"] == (90, 40)
    assert info["crop_top"] > 0  # the random crop took an offset, the same one for every frame
    for index, path in enumerate(sample.frame_paths):
        want, want_info = prepare_image(Image.open(tmp_path / path), sample.bucket, "random", sample.crop_seed)
        assert torch.equal(pixels[:, index], want)
        assert (want_info["crop_left"], want_info["crop_top"]) == (info["crop_left"], info["crop_top"])
    # Frames differ only by their brightness step: the pattern sits at the same place in all of them.
    steps = pixels[:, 1:] - pixels[:, :-1]
    assert torch.allclose(steps, torch.full_like(steps, 10 / 127.5), atol=1e-5)


def test_too_short_clips_are_named_together_before_training(tmp_path):
    write_frame_folder(tmp_path / "short_folder", 6)
    write_animation(tmp_path / "short.gif", 3)
    write_video(tmp_path / "long.mp4", 12)
    with pytest.raises(ValueError) as caught:
        scan(tmp_path, num_frames=5, frame_stride=2)  # needs 9 source frames
    message = str(caught.value)
    assert "2 of 3 clips" in message and "9 frames" in message and "num_frames=5 at frame_stride=2" in message
    assert "short_folder/: 6 frame(s)" in message and "short.gif: 3 frame(s)" in message
    assert "long.mp4" not in message
    assert "Lower `num_frames`" in message and "remove these clips" in message
    assert "the shortest clip, 3 frame(s), fits num_frames=1 at frame_stride=2)" in message
    assert scan(tmp_path, num_frames=1).samples  # one frame from each fits


def test_num_frames_must_be_4k_plus_1_and_video_needs_wan(tmp_path):
    with pytest.raises(ConfigError, match=r"num_frames 8 is not of the form 4k\+1.*use 5 or 9"):
        validate_config(config_for(tmp_path, num_frames=8), check_files=False)
    with pytest.raises(ConfigError, match="video model family"):
        validate_config(config_for(tmp_path, model_family="sd"), check_files=False)


def test_corrupt_clips_are_skipped_and_counted_and_stray_stills_refused(tmp_path):
    write_animation(tmp_path / "good.gif", 5)
    write_video(tmp_path / "good.mp4", 5)
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not a video")
    (tmp_path / "empty.gif").write_bytes(b"")
    dataset = scan(tmp_path, max_bad_image_fraction=0.6)
    assert sorted(s.path for s in dataset.samples) == ["good.gif", "good.mp4"]
    assert [path for path, _ in dataset.metadata.bad_files] == ["broken.mp4", "empty.gif"]
    with pytest.raises(ValueError, match=r"(?s)2 of 4 clips .* could not be read.*broken\.mp4: cannot read video: Inv"):
        scan(tmp_path, max_bad_image_fraction=0.5)  # half: the default stops

    Image.new("RGB", SIZE).save(tmp_path / "still.png")
    with pytest.raises(ValueError, match=r"still image\(s\) lie directly in .*still\.png.*sub-folder"):
        scan(tmp_path, max_bad_image_fraction=0.6)


def test_an_unreadable_frame_skips_its_folder_and_frames_must_share_a_size(tmp_path):
    write_frame_folder(tmp_path / "ok", 5)
    write_frame_folder(tmp_path / "gap", 5)
    (tmp_path / "gap" / "f3.png").unlink()  # a staging backend leaves out what it could not read
    unreadable = {"gap/f3.png": "Permission denied", "lost.mp4": "Permission denied"}
    clips, bad, _ = find_clips(LocalDataBackend(tmp_path, "clips"), unreadable)
    assert [clip.display for clip in clips] == ["ok/"]  # not a 4-frame clip with its frames shifted
    assert bad == [
        ("gap/", "frame f3.png cannot be read: Permission denied"),
        ("lost.mp4", "cannot read file: Permission denied"),
    ]

    shutil.rmtree(tmp_path / "gap")
    Image.new("RGB", (40, 40)).save(tmp_path / "ok" / "f4.png")
    dataset = scan(tmp_path)
    with pytest.raises(ValueError, match="frame f4.png is 40x40 but f1.png is 48x32; every frame of a clip"):
        load_sample_pixels(dataset, dataset.samples[0])  # the trainer skips it as undecodable


def test_cache_keys_see_frames_and_stride_and_images_keep_theirs(tmp_path):
    write_frame_folder(tmp_path / "clip", 10)
    base = scan(tmp_path, num_frames=5)
    (sample,) = base.samples
    key = sample_latent_key(base, sample, "vae-id", 32)
    assert key != sample_latent_key(base, scan(tmp_path, num_frames=9).samples[0], "vae-id", 32)
    assert key != sample_latent_key(base, scan(tmp_path, num_frames=5, frame_stride=2).samples[0], "vae-id", 32)
    # A frame it takes changes the key; one past the last it takes does not.
    os.utime(tmp_path / "clip" / "f10.png", ns=(1, 1))
    assert sample_latent_key(base, sample, "vae-id", 32) == key
    os.utime(tmp_path / "clip" / "f3.png", ns=(1, 1))
    assert sample_latent_key(base, sample, "vae-id", 32) != key

    image_dir = tmp_path / "images"
    image_dir.mkdir()
    Image.new("RGB", SIZE).save(image_dir / "a.png")
    raw = config_for(image_dir, dataset={"dataset_type": "image", "num_frames": None})
    config = validate_config(raw, check_files=False)
    backend = LocalDataBackend(image_dir, "clips")
    metadata = build_metadata(backend, config.datasets[0], config, seed=0)
    images = RegisteredDataset("clips", config.datasets[0], backend, metadata)
    (image,) = images.samples
    assert not image.is_video and (image.num_frames, image.frame_stride) == (1, 1)
    assert sample_latent_key(images, image, "vae-id", 32) == latent_cache_key(
        sample_key=image.key,
        file_identity=backend.identity("a.png"),
        bucket=image.bucket,
        crop={"style": image.crop_style, "seed": image.crop_seed},
        resolution=32,
        encoder_identity="vae-id",
        dtype="float32",
    )
    pixels, _ = load_sample_pixels(images, image)
    assert pixels.shape == (3, image.bucket[1], image.bucket[0])


def test_in_memory_backend_stages_clips_and_frames(tmp_path):
    write_frame_folder(tmp_path / "clip", 5)
    write_video(tmp_path / "pan.mp4", 5)
    raw = config_for(tmp_path, dataset={"type": "in_memory"})
    (dataset,) = build_datasets(validate_config(raw, check_files=False))
    assert {"clip/f1.png", "clip/f5.png", "pan.mp4"} <= set(dataset.backend.list_files())
    assert dataset.backend._entries["pan.mp4"].codec.name == "none"  # already compressed: kept as is
    local = scan(tmp_path)
    for sample, want in zip(dataset.samples, local.samples):
        assert torch.equal(load_sample_pixels(dataset, sample)[0], load_sample_pixels(local, want)[0])


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    from simpletuner.testing.zoo import write_tiny_wan

    return write_tiny_wan(tmp_path_factory.mktemp("tiny_wan_video") / "model")


def test_wan_lora_trains_on_five_frame_clips(tmp_path, tiny_wan):
    from training_helpers import train

    data = tmp_path / "data"
    write_frame_folder(data / "a", 5, size=(32, 32))
    write_frame_folder(data / "b", 6, size=(32, 32))
    write_animation(data / "c.gif", 5, size=(32, 32))
    write_video(data / "d.mp4", 7, size=(32, 32))
    raw = config_for(
        data,
        model_dir=str(tiny_wan),
        output_dir=str(tmp_path / "out"),
        train_batch_size=2,
        max_train_steps=2,
        learning_rate=1e-3,
        seed=1,
        dataset={"instance_prompt": "a clip"},
        cache_config={"cache_dir": str(tmp_path / "cache")},
    )
    trainer, result = train(raw)
    assert result.global_step == 2 and all(np.isfinite(result.losses)) and len(result.losses) == 2
    samples = trainer.state.datasets[0].samples
    batch = trainer.data.batch(samples[:2], torch.device("cpu"))
    assert batch.latents.shape == (2, 4, 2, 4, 4)  # [B, C, (5 - 1) // 4 + 1 latent frames, 32 / 8, 32 / 8]
    assert result.output_path.is_file()
