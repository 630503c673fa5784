"""Video validation: a video family's validation clips are saved as .mp4 (PyAV), else animated .webp,
else animated .gif, at the family's frame rate, and go to TensorBoard (``add_video``) and W&B
(``wandb.Video``); an image family's validation writes and logs exactly what it did before.

The tiny Wan pipeline renders the clips (1 step, 5 frames, 48x32); files are read back with PyAV
and Pillow; TensorBoard is a real ``SummaryWriter`` where it can be (no moviepy here: the warning
path) and a recording writer for the ``add_video`` call; W&B is a recording ``wandb`` module."""

from __future__ import annotations

import io
import logging
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from training_helpers import tiny_config

from simpletuner.configuration import validate_config
from simpletuner.models import get_model_spec
from simpletuner.testing.zoo import write_tiny_model
from simpletuner.training import validation
from simpletuner.training.validation import encode_video, generate_validation_images

CPU = torch.device("cpu")
PROMPTS = ["a red square", "a blue circle"]


def _parts(config):
    spec = get_model_spec(config)
    text = spec.load_text_encoders(CPU, torch.float32)
    vae = spec.load_vae(CPU, torch.float32)
    denoiser = spec.prepare_denoiser(spec.load_denoiser(torch.float32), torch.float32)
    return spec, denoiser, vae, text


@pytest.fixture(scope="module")
def wan(tmp_path_factory, shapes_dir):
    """The tiny Wan model, loaded once: (config, spec, denoiser, vae, text encoders)."""
    root = tmp_path_factory.mktemp("wan-video")
    model = write_tiny_model("wan", root / "model")
    raw = tiny_config(
        model,
        shapes_dir,
        root,
        model_family="wan",
        resolution=32,
        validation_prompts=PROMPTS,
        validation_num_inference_steps=1,
        validation_num_video_frames=5,
        validation_resolution="48x32",
    )
    config = validate_config(raw)
    return (config, *_parts(config))


@pytest.fixture(autouse=True)
def fresh_probes():
    """The format / moviepy probes are cached per process: each test starts (and leaves) them unprobed."""
    validation.video_format.cache_clear()
    validation.tensorboard_can_write_video.cache_clear()
    yield
    validation.video_format.cache_clear()
    validation.tensorboard_can_write_video.cache_clear()


class RecordingWriter:
    """A TensorBoard writer that records each ``add_*`` call as (method, args, kwargs)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if not name.startswith("add_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def _trackers():
    """A recording TensorBoard tracker and a recording W&B tracker (its logs: (dict, step))."""
    logs = []
    tensorboard = SimpleNamespace(name="tensorboard", writer=RecordingWriter())
    wandb_tracker = SimpleNamespace(name="wandb", log=lambda values, step: logs.append((values, step)))
    return tensorboard, wandb_tracker, logs


def _fake_wandb():
    """A ``wandb`` module whose Image / Video record their arguments."""
    module = types.ModuleType("wandb")

    class Image_:
        def __init__(self, data, caption=None):
            self.data, self.caption = data, caption

    class Video:
        def __init__(self, data_or_path, caption=None, fps=None, format=None):
            self.data_or_path, self.caption, self.fps, self.format = data_or_path, caption, fps, format

    module.Image, module.Video = Image_, Video
    return module


def _moviepy_importable(monkeypatch):
    """``from moviepy import editor`` succeeds (a stand-in module: the call it gates is recorded, not run)."""
    moviepy = types.ModuleType("moviepy")
    moviepy.editor = types.ModuleType("moviepy.editor")
    monkeypatch.setitem(sys.modules, "moviepy", moviepy)
    monkeypatch.setitem(sys.modules, "moviepy.editor", moviepy.editor)


def _mp4_frames(path):
    """The decoded frames of ``path`` as RGB arrays, and its stream's average frame rate."""
    av = pytest.importorskip("av")
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return frames, stream.average_rate


def _close(a, b, tolerance=12.0) -> bool:
    """Lossy-codec equality: the mean absolute difference of two uint8 images within ``tolerance``."""
    return float(np.abs(a.astype(np.float32) - b.astype(np.float32)).mean()) <= tolerance


# --- .mp4 and the trackers ---------------------------------------------------------------------


def test_wan_validation_writes_mp4s_and_hands_them_to_the_trackers(wan, tmp_path, monkeypatch):
    pytest.importorskip("av")  # .mp4 clips need PyAV
    config, spec, denoiser, vae, text = wan
    assert spec.video_fps == 16
    _moviepy_importable(monkeypatch)
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb())
    tensorboard, wandb_tracker, logs = _trackers()
    out = tmp_path / "v"
    paths = generate_validation_images(spec, denoiser, vae, text, config, 7, out, [tensorboard, wandb_tracker])

    # Files: a PNG (first frame) and an .mp4 (whole clip) per prompt, with the same stem; the grid.
    assert [p.name for p in paths] == ["step_000007_0.png", "step_000007_1.png"]
    assert sorted(f.name for f in out.iterdir()) == [
        "step_000007_0.mp4",
        "step_000007_0.png",
        "step_000007_1.mp4",
        "step_000007_1.png",
        "step_000007_grid.png",
    ]
    first_frames = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    for png, first in zip(paths, first_frames):
        frames, rate = _mp4_frames(png.with_suffix(".mp4"))
        assert len(frames) == 5 and frames[0].shape == (32, 48, 3) and rate == 16
        assert _close(frames[0], first)  # the clip starts with the PNG's frame

    # TensorBoard: images and grid as before, then one add_video of both clips, [N, T, C, H, W] uint8.
    calls = tensorboard.writer.calls
    assert [(name, args[0]) for name, args, _ in calls] == [
        ("add_images", "validation"),
        ("add_image", "validation_grid"),
        ("add_video", "validation_video"),
    ]
    _, (tag, batch, step), kwargs = calls[2]
    assert kwargs == {"fps": 16} and step == 7
    assert batch.dtype == torch.uint8 and tuple(batch.shape) == (2, 5, 3, 32, 48)
    for clip, first in zip(batch, first_frames):  # frame 0 of each clip is its PNG, exactly (both lossless)
        assert np.array_equal(clip[0].permute(1, 2, 0).numpy(), first)

    # W&B: the grid as before, and one wandb.Video per clip: the .mp4 file itself, captioned with its prompt.
    ((logged, step),) = logs
    assert step == 7 and set(logged) == {"validation_grid", "validation_video"}
    videos = logged["validation_video"]
    assert [(v.data_or_path, v.fps, v.format, v.caption) for v in videos] == [
        (str(out / "step_000007_0.mp4"), 16, "mp4", PROMPTS[0]),
        (str(out / "step_000007_1.mp4"), 16, "mp4", PROMPTS[1]),
    ]


def test_the_frame_rate_is_the_familys(wan, tmp_path, monkeypatch):
    pytest.importorskip("av")  # .mp4 clips need PyAV
    config, spec, denoiser, vae, text = wan
    monkeypatch.setattr(spec, "video_fps", 8)
    (png, _) = generate_validation_images(spec, denoiser, vae, text, config, 1, tmp_path)
    frames, rate = _mp4_frames(png.with_suffix(".mp4"))
    assert rate == 8 and len(frames) == 5


def test_odd_sides_are_padded_to_even_for_h264():
    """yuv420p needs even sides: a 5x3 clip becomes 6x4, the new column / row copying the last one."""
    av = pytest.importorskip("av")
    frames = [Image.new("RGB", (5, 3), (200, 40, 90)) for _ in range(3)]
    data = encode_video(frames, 8, "mp4")
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        assert stream.average_rate == 8
    assert len(decoded) == 3 and decoded[0].shape == (4, 6, 3)
    expected = np.zeros((4, 6, 3), np.uint8) + np.array([200, 40, 90], np.uint8)  # padding repeats the edge
    assert all(_close(d, expected, tolerance=6.0) for d in decoded)
    assert all(_close(d[:, 5], expected[:, 5], tolerance=6.0) and _close(d[3], expected[3], 6.0) for d in decoded)


# --- without PyAV: animated .webp, else .gif -----------------------------------------------------


def test_without_pyav_clips_are_animated_webp_and_wandb_gets_a_gif(wan, tmp_path, monkeypatch, caplog):
    config, spec, denoiser, vae, text = wan
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb())
    _, wandb_tracker, logs = _trackers()
    with caplog.at_level(logging.WARNING, logger="simpletuner.training.validation"):
        paths = generate_validation_images(spec, denoiser, vae, text, config, 3, tmp_path / "a", [wandb_tracker])
        generate_validation_images(spec, denoiser, vae, text, config, 4, tmp_path / "b")
    warnings = [r.getMessage() for r in caplog.records if "validation videos are saved as" in r.getMessage()]
    assert len(warnings) == 1 and "animated .webp" in warnings[0] and "pip install av" in warnings[0]

    for png in paths:
        clip = Image.open(png.with_suffix(".webp"))
        assert clip.format == "WEBP" and clip.n_frames == 5 and clip.size == (48, 32)
        assert _close(np.asarray(clip.convert("RGB")), np.asarray(Image.open(png).convert("RGB")))
        clip.seek(1)
        clip.load()  # Pillow reads a WebP frame's timing as it decodes it
        assert clip.info["duration"] == round(1000 / 16) and clip.info["loop"] == 0
    assert not list((tmp_path / "a").glob("*.mp4")) and not list((tmp_path / "a").glob("*.gif"))

    # W&B plays no .webp: it gets the frames as an in-memory GIF.
    ((logged, _),) = logs
    for video, prompt in zip(logged["validation_video"], PROMPTS):
        assert video.format == "gif" and video.fps == 16 and video.caption == prompt
        gif = Image.open(video.data_or_path)
        assert gif.format == "GIF" and gif.n_frames == 5 and gif.size == (48, 32)


def test_gif_is_the_last_fallback(tmp_path, monkeypatch, caplog):
    """Neither H.264 nor animated WebP encodes: the clip is an animated .gif, said once in the log."""
    real = validation.encode_video

    def only_gif(frames, fps, fmt):
        if fmt != "gif":
            raise RuntimeError(f"no {fmt} encoder")
        return real(frames, fps, fmt)

    monkeypatch.setattr(validation, "encode_video", only_gif)
    frames = [Image.new("RGB", (16, 16), (30 * i, 0, 0)) for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="simpletuner.training.validation"):
        first = validation.save_video(frames, tmp_path / "step_000001_0.png", 16)
        second = validation.save_video(frames, tmp_path / "step_000002_0.png", 16)
    assert (first.name, second.name) == ("step_000001_0.gif", "step_000002_0.gif")
    gif = Image.open(first)
    assert gif.n_frames == 5 and gif.size == (16, 16)
    warnings = [r.getMessage() for r in caplog.records if "validation videos are saved as" in r.getMessage()]
    assert len(warnings) == 1 and "animated .gif" in warnings[0] and "cannot write animated WebP" in warnings[0]


# --- TensorBoard without moviepy --------------------------------------------------------------


def test_tensorboard_without_moviepy_warns_once_and_keeps_the_images(wan, tmp_path, monkeypatch, caplog):
    pytest.importorskip("av")  # .mp4 clips need PyAV
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    config, spec, denoiser, vae, text = wan
    monkeypatch.setitem(sys.modules, "moviepy", None)  # `from moviepy import editor` raises ImportError
    writer = SummaryWriter(str(tmp_path / "tb"))
    tracker = SimpleNamespace(name="tensorboard", writer=writer)
    with caplog.at_level(logging.WARNING, logger="simpletuner.training.validation"):
        for step in (1, 2):
            generate_validation_images(spec, denoiser, vae, text, config, step, tmp_path / "v", [tracker])
    writer.close()
    warnings = [r.getMessage() for r in caplog.records if "TensorBoard gets no validation videos" in r.getMessage()]
    assert len(warnings) == 1 and 'pip install "moviepy<2"' in warnings[0]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["images"]) == ["validation", "validation_grid"]  # no validation_video
    assert [e.step for e in events.Images("validation_grid")] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "v").glob("*.mp4")) == [
        f"step_00000{s}_{k}.mp4" for s in (1, 2) for k in (0, 1)
    ]


# --- image families: unchanged ------------------------------------------------------------------


def test_an_image_family_writes_and_logs_as_before(make_config, tmp_path, monkeypatch, caplog):
    config = validate_config(make_config(validation_prompt="a red circle", validation_num_inference_steps=1))
    spec, denoiser, vae, text = _parts(config)
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb())
    monkeypatch.setitem(sys.modules, "moviepy", None)  # no moviepy: still no warning, no video is logged
    tensorboard, wandb_tracker, logs = _trackers()
    out = tmp_path / "v"
    with caplog.at_level(logging.WARNING, logger="simpletuner.training.validation"):
        paths = generate_validation_images(spec, denoiser, vae, text, config, 2, out, [tensorboard, wandb_tracker])
    assert [p.name for p in paths] == ["step_000002_0.png"]
    assert sorted(f.name for f in out.iterdir()) == ["step_000002_0.png", "step_000002_grid.png"]
    image = np.asarray(Image.open(paths[0]).convert("RGB"))
    grid = np.asarray(Image.open(out / "step_000002_grid.png").convert("RGB"))

    (images_call, grid_call) = tensorboard.writer.calls
    assert images_call[0] == "add_images" and images_call[2] == {"dataformats": "NHWC"}
    tag, stacked, step = images_call[1]
    assert (tag, step) == ("validation", 2) and np.array_equal(stacked, image[None])
    assert grid_call[0] == "add_image" and grid_call[2] == {"dataformats": "HWC"}
    tag, logged_grid, step = grid_call[1]
    assert (tag, step) == ("validation_grid", 2) and np.array_equal(logged_grid, grid)

    ((logged, step),) = logs
    assert step == 2 and list(logged) == ["validation_grid"]
    assert logged["validation_grid"].caption == "row 0: a red circle"
    assert not caplog.records
