"""Video clips: finding them in a dataset folder, reading their size and frame count cheaply, and
decoding the frames a sample trains on.

Clips are video files (``.mp4 .webm .mov .mkv``, PyAV), animated ``.gif`` / ``.webp`` (Pillow) or frame
folders (stills ordered by the numbers in their names; the caption is ``<folder>.txt`` beside it). A sample
takes ``num_frames`` frames, every ``frame_stride``-th (:func:`frames_needed`), each resized and cropped as
:func:`~simpletuner.data_backend.images.prepare_image` does, one crop for the whole clip.
See documentation/QUICKSTART.md, "Video datasets".
"""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Mapping

import torch
from PIL import Image

from simpletuner.data_backend.base import (
    ANIMATED_IMAGE_EXTENSIONS,
    IMAGE_EXTENSIONS,
    VIDEO_FILE_EXTENSIONS,
    DataBackend,
    SupportsReadHead,
)
from simpletuner.data_backend.images import _DECODE_ERRORS, image_size_of, load_rgb, prepare_image, to_rgb

if TYPE_CHECKING:
    from simpletuner.data_backend.metadata import Sample

#: ``Sample.media`` of the clip kinds: a PyAV video file, a Pillow animation, a folder of frames.
VIDEO_FILE, ANIMATED, FRAME_FOLDER = "video", "animated", "frames"
#: Too-short clips named in the error.
NUM_TOO_SHORT_SHOWN = 50
#: What a video dataset is searched for (in messages).
CLIP_KINDS = (
    ".mp4/.webm/.mov/.mkv files, animated .gif/.webp, or sub-folders of .jpg/.jpeg/.png/.webp frames (one per clip)"
)

_DIGITS = re.compile(r"(\d+)")
#: An animated WebP says so in its first 21 bytes: "RIFF" size "WEBP" "VP8X" size, then the
#: VP8X flags, whose bit 1 is "animation".
_WEBP_HEAD_BYTES = 21
_WEBP_ANIMATION_FLAG = 0x02


@dataclass(frozen=True)
class Clip:
    """One clip of a video dataset: a file, or a frame folder with all its frames in order."""

    path: str  # the file, or the frame folder (relative, no trailing slash)
    media: str  # VIDEO_FILE, ANIMATED or FRAME_FOLDER
    frames: tuple[str, ...] = ()  # a frame folder's frame files, in natural order

    @property
    def display(self) -> str:
        """The path as shown in messages: a frame folder ends with ``/``."""
        return f"{self.path}/" if self.media == FRAME_FOLDER else self.path


def frames_needed(num_frames: int, frame_stride: int) -> int:
    """Source frames a clip needs: ``(num_frames - 1) * frame_stride + 1``."""
    return (num_frames - 1) * frame_stride + 1


def frame_indices(num_frames: int, frame_stride: int) -> list[int]:
    """The source frames a sample takes: ``0, stride, 2 * stride, ...`` (``num_frames`` of them)."""
    return list(range(0, frames_needed(num_frames, frame_stride), frame_stride))


def natural_key(path: str) -> tuple:
    """Sort key of a file name with its numbers compared by value: ``f2.png`` before ``f10.png``."""
    name = PurePosixPath(path).name.lower()
    parts = _DIGITS.split(name)  # text at even positions, digit runs at odd ones
    return tuple(int(part) if i % 2 else part for i, part in enumerate(parts)), name


def require_av() -> Any:
    """The ``av`` module (PyAV).

    Raises:
        ImportError: PyAV is not installed; the message gives the install command.
    """
    try:
        import av
    except ImportError:
        raise ImportError(
            'reading .mp4/.webm/.mov/.mkv clips needs PyAV: `pip install -e ".[video]"` in the simpletuner checkout '
            "(or `pip install av`). "
            "Animated .gif/.webp and frame folders need nothing extra"
        ) from None
    return av


def _is_animated_webp(backend: DataBackend, path: str) -> bool:
    head = backend.read_head(path, _WEBP_HEAD_BYTES) if isinstance(backend, SupportsReadHead) else backend.read(path)
    return (
        len(head) >= _WEBP_HEAD_BYTES
        and head[:4] == b"RIFF"
        and head[8:16] == b"WEBPVP8X"
        and bool(head[20] & _WEBP_ANIMATION_FLAG)
    )


def _parent(path: str) -> str:
    parent = PurePosixPath(path).parent.as_posix()
    return "" if parent == "." else parent


def find_clips(
    backend: DataBackend, unreadable: Mapping[str, str]
) -> tuple[list[Clip], list[tuple[str, str]], list[str]]:
    """Every clip under the root of ``backend``, sorted by path.

    ``unreadable`` maps files the backend found but could not read before the scan to the reason.

    Returns:
        ``(clips, bad, stray)``: ``bad`` lists ``(path, reason)`` of clips that cannot be used (the
        file could not be read, or a frame of the folder could not: a folder missing a frame would
        silently shift the frames taken); ``stray`` lists still images directly under the root,
        which belong to no clip.
    """
    clips: list[Clip] = []
    bad: list[tuple[str, str]] = []
    folders: dict[str, list[str]] = {}
    for path in backend.list_files(VIDEO_FILE_EXTENSIONS | ANIMATED_IMAGE_EXTENSIONS | IMAGE_EXTENSIONS):
        suffix = PurePosixPath(path).suffix.lower()
        if suffix in VIDEO_FILE_EXTENSIONS:
            clips.append(Clip(path, VIDEO_FILE))
            continue
        try:
            is_animation = suffix == ".gif" or (suffix == ".webp" and _is_animated_webp(backend, path))
        except OSError as exc:
            bad.append((path, f"cannot read file: {exc.strerror or exc}"))
            continue
        if is_animation:
            clips.append(Clip(path, ANIMATED))
        else:
            folders.setdefault(_parent(path), []).append(path)
    stray = folders.pop("", [])
    broken: dict[str, str] = {}
    for path, reason in sorted(unreadable.items()):
        suffix, parent = PurePosixPath(path).suffix.lower(), _parent(path)
        if suffix in IMAGE_EXTENSIONS and parent:
            broken.setdefault(parent, f"frame {PurePosixPath(path).name} cannot be read: {reason}")
        elif suffix in VIDEO_FILE_EXTENSIONS | ANIMATED_IMAGE_EXTENSIONS:
            bad.append((path, f"cannot read file: {reason}"))
        elif suffix in IMAGE_EXTENSIONS:
            stray.append(path)
    for folder, frames in folders.items():
        if folder not in broken:
            clips.append(Clip(folder, FRAME_FOLDER, tuple(sorted(frames, key=natural_key))))
    bad.extend((f"{folder}/", reason) for folder, reason in broken.items())
    clips.sort(key=lambda clip: clip.path)
    return clips, sorted(bad), sorted(stray)


def probe_clip(backend: DataBackend, clip: Clip) -> tuple[int, int, int]:
    """``(width, height, num_frames)`` of ``clip`` without decoding its pictures.

    The size is the first frame's. The count is the number of frame files of a folder, Pillow's
    ``n_frames`` of an animation, and for a video file the container's frame count, or its
    demuxed packet count where the container does not record one (WebM/Matroska).

    Raises:
        ValueError: the clip cannot be read (empty, not a video, no video stream, no frames).
        OSError: the file cannot be read from the backend.
    """
    if clip.media == FRAME_FOLDER:
        width, height = image_size_of(backend, clip.frames[0])
        return width, height, len(clip.frames)
    data = backend.read(clip.path)
    if not data:
        raise ValueError("empty file (0 bytes)")
    if clip.media == ANIMATED:
        try:
            with Image.open(io.BytesIO(data)) as image:
                (width, height), count = image.size, getattr(image, "n_frames", 1)
        except Image.UnidentifiedImageError:
            raise ValueError("not a recognised image (unknown format or header cut off)") from None
        except _DECODE_ERRORS as exc:
            raise ValueError(f"unreadable animated image: {exc}") from None
    else:
        av = require_av()
        try:
            with av.open(io.BytesIO(data), mode="r") as container:
                stream = _video_stream(container)
                width, height = stream.codec_context.width, stream.codec_context.height
                count = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        except av.FFmpegError as exc:
            raise ValueError(f"cannot read video: {_av_reason(exc)}") from None
    if width <= 0 or height <= 0:
        raise ValueError(f"clip has no pixels ({width}x{height})")
    if count <= 0:
        raise ValueError("clip has no frames")
    return width, height, count


def _av_reason(exc: Exception) -> str:
    """FFmpeg's own message ("Invalid data found when processing input"), without the errno and
    the '<none>' file name of an in-memory read."""
    return getattr(exc, "strerror", None) or str(exc)


def _video_stream(container: Any) -> Any:
    if not container.streams.video:
        raise ValueError("file holds no video stream")
    return container.streams.video[0]


def read_clip_frames(backend: DataBackend, sample: Sample) -> list[Image.Image]:
    """The RGB frames ``sample`` trains on (:func:`frame_indices` of its clip), in order.

    Raises:
        ValueError: the clip or one of the frames cannot be decoded, or it ends too early.
        OSError: a file cannot be read from the backend.
    """
    indices = frame_indices(sample.num_frames, sample.frame_stride)
    if sample.media == FRAME_FOLDER:
        frames = []
        for path in sample.frame_paths:
            name = PurePosixPath(path).name
            try:
                frames.append(load_rgb(backend.read(path)))
            except ValueError as exc:
                raise ValueError(f"frame {name}: {exc}") from None
            if frames[-1].size != frames[0].size:
                (w, h), (w0, h0) = frames[-1].size, frames[0].size
                first = PurePosixPath(sample.frame_paths[0]).name
                raise ValueError(
                    f"frame {name} is {w}x{h} but {first} is {w0}x{h0}; every frame of a clip must have one size"
                )
        return frames
    data = backend.read(sample.path)
    if not data:
        raise ValueError("empty file (0 bytes)")
    if sample.media == ANIMATED:
        return _decode_animation(data, indices)
    return _decode_video(data, indices)


def _decode_animation(data: bytes, indices: list[int]) -> list[Image.Image]:
    frames = []
    try:
        with Image.open(io.BytesIO(data)) as image:
            for index in indices:
                image.seek(index)
                frames.append(to_rgb(image.copy()))
    except EOFError:
        raise ValueError(f"the animation ends before frame {indices[len(frames)] + 1}") from None
    except Image.UnidentifiedImageError:
        raise ValueError("not a recognised image (unknown format or header cut off)") from None
    except _DECODE_ERRORS as exc:
        raise ValueError(f"cannot decode animation: {exc}") from None
    return frames


def _decode_video(data: bytes, indices: list[int]) -> list[Image.Image]:
    av = require_av()
    wanted, last = set(indices), indices[-1]
    frames: list[Image.Image] = []
    decoded = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            for frame in container.decode(_video_stream(container)):
                if decoded in wanted:
                    frames.append(frame.to_image())
                decoded += 1
                if decoded > last:
                    break
    except av.FFmpegError as exc:
        raise ValueError(f"cannot decode video: {_av_reason(exc)}") from None
    if len(frames) < len(indices):
        raise ValueError(f"only {decoded} frame(s) could be decoded; the sample needs frame {last + 1}")
    return frames


def prepare_clip(
    frames: list[Image.Image],
    bucket: tuple[int, int],
    crop_style: str,
    crop_seed: int,
    canvas: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, dict]:
    """Every frame through :func:`~simpletuner.data_backend.images.prepare_image` with the same
    bucket, seed and canvas (so the same resize and crop): ``([3, F, H, W] in [-1, 1], first frame's info)``.

    Raises:
        ValueError: the frames do not all have the first frame's size.
    """
    size = frames[0].size
    for index, frame in enumerate(frames):
        if frame.size != size:
            raise ValueError(
                f"frame {index + 1} of the sample is {frame.size[0]}x{frame.size[1]} but the first is "
                f"{size[0]}x{size[1]}; every frame of a clip must have one size"
            )
    prepared = [prepare_image(frame, bucket, crop_style, crop_seed, canvas) for frame in frames]
    return torch.stack([pixels for pixels, _ in prepared], dim=1).contiguous(), dict(prepared[0][1])


def load_clip_pixels(backend: DataBackend, sample: Sample) -> tuple[torch.Tensor, dict]:
    """Decode, resize and crop a video ``sample``: ``([3, num_frames, H, W] in [-1, 1], crop info)``;
    the info adds ``num_frames`` and ``frame_stride`` to what ``prepare_image`` reports."""
    frames = read_clip_frames(backend, sample)
    pixels, info = prepare_clip(frames, sample.bucket, sample.crop_style, sample.crop_seed, sample.canvas)
    info.update(num_frames=sample.num_frames, frame_stride=sample.frame_stride)
    return pixels, info


def sample_identity(backend: DataBackend, sample: Sample) -> str:
    """What changes when the files of ``sample`` do (a cache-key part): ``backend.identity`` of its
    file, or for a frame folder a hash of the path and identity of every frame it takes."""
    if sample.media != FRAME_FOLDER:
        return backend.identity(sample.path)
    digest = hashlib.sha256()
    for path in sample.frame_paths:
        digest.update(f"{path}\x00{backend.identity(path)}\x00".encode("utf-8", "surrogateescape"))
    return f"frames:{digest.hexdigest()}"


def _largest_num_frames(num_source: int, frame_stride: int) -> int:
    """The largest ``4k+1`` num_frames a clip of ``num_source`` frames holds at ``frame_stride``."""
    most = (num_source - 1) // frame_stride + 1
    return most - (most - 1) % 4


def too_short_error(
    dataset_id: str, root: str, too_short: list[tuple[str, int]], num_clips: int, num_frames: int, frame_stride: int
) -> ValueError:
    """The error naming every clip (up to :data:`NUM_TOO_SHORT_SHOWN`) with fewer frames than
    ``num_frames`` at ``frame_stride`` takes, with their frame counts and what would fit."""
    need = frames_needed(num_frames, frame_stride)
    listed = "\n".join(f"  - {path}: {count} frame(s)" for path, count in too_short[:NUM_TOO_SHORT_SHOWN])
    if len(too_short) > NUM_TOO_SHORT_SHOWN:
        listed += f"\n  ... and {len(too_short) - NUM_TOO_SHORT_SHOWN} more"
    shortest = min(count for _, count in too_short)
    fits = [f"num_frames={_largest_num_frames(shortest, frame_stride)} at frame_stride={frame_stride}"]
    if frame_stride > 1 and _largest_num_frames(shortest, 1) > _largest_num_frames(shortest, frame_stride):
        fits.append(f"num_frames={_largest_num_frames(shortest, 1)} at frame_stride=1")
    if num_frames > 1 and (shortest - 1) // (num_frames - 1) >= 1 and frame_stride > 1:
        fits.append(f"num_frames={num_frames} at frame_stride={(shortest - 1) // (num_frames - 1)}")
    return ValueError(
        f"dataset {dataset_id!r}: {len(too_short)} of {num_clips} clips under {root} have fewer than the {need} frames "
        f"that num_frames={num_frames} at frame_stride={frame_stride} takes ((num_frames - 1) * frame_stride + 1):\n"
        f"{listed}\nLower `num_frames` (4k+1) or `frame_stride` (the shortest clip, {shortest} frame(s), fits "
        f"{' or '.join(fits)}), or remove these clips from the dataset."
    )


def stray_images_error(dataset_id: str, root: str, stray: list[str]) -> ValueError:
    """The error for still images directly under a video dataset's root (they belong to no clip)."""
    shown = ", ".join(stray[:5]) + (f" and {len(stray) - 5} more" if len(stray) > 5 else "")
    return ValueError(
        f"dataset {dataset_id!r} has dataset_type 'video' but {len(stray)} still image(s) lie directly in {root} "
        f"({shown}); a video dataset's clips are {CLIP_KINDS}. Move each clip's frames into a sub-folder of their own, "
        "or put still images in a separate dataset with dataset_type 'image'"
    )
