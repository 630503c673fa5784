"""Dataset metadata: one scan of the files gives each image (or clip) its caption, size and bucket.

The scan reads image headers (and a file's last bytes) only, decoding pixels only of a file that looks
cut off, so it stays fast on large folders; a video dataset's clips are found and probed by
``simpletuner.data_backend.video`` (size and frame count from headers and container metadata), and clips
too short for ``num_frames`` stop the run. Unreadable files are skipped and listed; half a dataset or more
(``max_bad_image_fraction``) stops the run, because a dataset that is mostly unreadable usually means a
wrong folder or a failed copy (:mod:`simpletuner.data_backend.bad_files`). Captions:
:mod:`simpletuner.data_backend.captions`.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Mapping

from tqdm.auto import tqdm

from simpletuner.configuration.sections import METADATA_CAPTION_STRATEGIES
from simpletuner.data_backend.bad_files import check_bad_files, format_bad, report_after_fill, warn_skipped
from simpletuner.data_backend.base import IMAGE_EXTENSIONS, DataBackend
from simpletuner.data_backend.caption_files import load_caption_table
from simpletuner.data_backend.captions import CaptionNotes, caption_file, captions_for
from simpletuner.data_backend.captions import caption_for as caption_for
from simpletuner.data_backend.captions import caption_from_filename as caption_from_filename
from simpletuner.data_backend.captions import caption_from_filename_cleaned as caption_from_filename_cleaned
from simpletuner.data_backend.geometry import geometry_for
from simpletuner.data_backend.images import image_size_reader
from simpletuner.data_backend.pairs import aspect_problem, find_sources, has_sources
from simpletuner.data_backend.size_rules import SizeRules as _SizeRules
from simpletuner.data_backend.video import (
    CLIP_KINDS,
    FRAME_FOLDER,
    VIDEO_FILE,
    Clip,
    find_clips,
    frame_indices,
    frames_needed,
    probe_clip,
    require_av,
    stray_images_error,
    too_short_error,
)
from simpletuner.faults import fault_point

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sample:
    """One training image or clip: where it is, its caption, and the bucket and crop it trains at.

    A clip (``media`` other than ``"image"``) trains on ``num_frames`` frames taken every
    ``frame_stride`` frames from its start, all with the same crop.
    """

    key: str  # f"{dataset_id}/{path}": unique across datasets, the cache key's sample part
    dataset_id: str
    path: str  # relative to the dataset root
    caption: str
    original_size: tuple[int, int]  # (width, height) after EXIF orientation
    bucket: tuple[int, int]  # (width, height) it is cropped to
    crop_style: str
    crop_seed: int
    num_frames: int = 1
    frame_stride: int = 1
    media: str = "image"  # or a clip's kind: "video" (PyAV file), "animated" (gif/webp), "frames" (a folder)
    frame_paths: tuple[str, ...] = ()  # a frame folder's frames this sample takes, in order
    is_regularisation_data: bool = False  # from a dataset with `is_regularisation_data` (its batches' target)
    #: The size the image is resized to before its crop (``maximum_image_size``), or None: just cover the bucket.
    canvas: tuple[int, int] | None = None
    #: An edit pair's source (conditioning) image: its absolute path (:mod:`simpletuner.data_backend.pairs`), or None.
    source: str | None = None
    #: A caption file of several lines (``disable_multiline_split`` off): its lines, each a caption; ``caption`` is
    #: the first. Each draw trains on one (:func:`~simpletuner.data_backend.captions.caption_line_index`). Empty:
    #: ``caption`` is the only one.
    caption_lines: tuple[str, ...] = ()

    @property
    def captions(self) -> tuple[str, ...]:
        """Every caption this sample may train with: its lines, or ``caption`` alone."""
        return self.caption_lines or (self.caption,)

    @property
    def is_video(self) -> bool:
        """Whether this sample is a clip (pixels ``[3, F, H, W]``) rather than an image."""
        return self.media != "image"


@dataclass
class DatasetMetadata:
    """The result of scanning one dataset.

    ``samples`` holds each image ``1 + repeats`` times; ``bad_files`` lists skipped files as
    ``(path, reason)``; ``caption_sources`` counts where captions came from (``textfile``,
    ``instance_prompt``, ``filename``, ``filename_cleaned``, or a metadata file: ``parquet``, ``csv``, ``jsonl``), per
    distinct image.
    """

    samples: list[Sample] = field(default_factory=list)
    bad_files: list[tuple[str, str]] = field(default_factory=list)
    caption_sources: dict[str, int] = field(default_factory=dict)
    num_files: int = 0  # image files (or clips) found, readable or not
    noun: str = "image files"  # what the dataset holds, in messages ("clips" for video)
    #: Readable images left out by the dataset's size rules, by rule (``minimum_image_size``,
    #: ``allow_upscale``); not bad files (they do not count towards ``max_bad_image_fraction``).
    num_skipped_small: dict[str, int] = field(default_factory=dict)

    def drop_unreadable(self, dataset_id: str, root: str, failures: dict[str, str], limit: float) -> None:
        """At the end of the cache fill: remove the samples whose image failed to decode there (e.g. a
        corrupt body behind a good header), record them as bad files, apply ``max_bad_image_fraction`` again
        over all the dataset's bad files (:func:`~simpletuner.data_backend.bad_files.check_bad_files`), and
        name every bad file of the dataset in one warning. ``failures`` must be the same on every process
        of a launch (the fill merges what each found), so every process keeps the same samples."""
        new = sorted(failures.items())
        if new:
            self.samples = [s for s in self.samples if s.path not in failures]
            self.bad_files.extend(new)
            check_bad_files(dataset_id, root, self.num_files, self.bad_files, limit, self.noun)
        if not self.samples:
            raise ValueError(
                f"dataset {dataset_id!r}: none of the {self.noun} under {root} could be decoded:\n"
                f"{format_bad(self.bad_files)}"
            )
        report_after_fill(dataset_id, self.num_files, self.bad_files, len(new), self.noun)


def crop_seed_for(seed: int, key: str) -> int:
    """A stable non-negative 63-bit seed from the run seed and the sample key (sha256)."""
    digest = hashlib.sha256(f"{seed}\x00{key}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def display_path(path: str) -> str:
    """``path`` safe to print and log: bytes of a file name that is not valid UTF-8 (which
    Python holds as lone surrogates) are shown as ``\\xNN`` escapes."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _is_utf8_name(path: str) -> bool:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _caption_problem(
    backend: DataBackend, path: str, dataset_cfg: Any, unreadable: Mapping[str, str], is_folder: bool = False
) -> str | None:
    """Why the caption file of ``path`` cannot be used, or None when it is fine or absent.

    A caption file that exists but cannot be read skips its image: falling back to
    ``instance_prompt`` or the file name would silently train on a different caption.
    """
    if dataset_cfg.caption_strategy != "textfile":
        return None
    text_path = caption_file(path, is_folder=is_folder)
    if text_path in unreadable:
        return f"caption file {text_path} cannot be read: {unreadable[text_path]}"
    return None


def _describe_root(backend: DataBackend, dataset_cfg: Any) -> str:
    root = getattr(backend, "root", None) or getattr(dataset_cfg, "instance_data_dir", None)
    return str(root) if root is not None else f"dataset {backend.id!r}"


def build_metadata(
    backend: DataBackend,
    dataset_cfg: Any,
    config: "TrainingConfig",
    seed: int,
    unreadable: Mapping[str, str] | None = None,
) -> DatasetMetadata:
    """Scan ``backend`` for images (clips for ``dataset_type: video``) and give each a caption,
    size, bucket and crop seed.

    Resolution is ``dataset_cfg.resolution`` or ``config.resolution``; buckets are aligned to
    ``config.aspect_bucket_alignment``. Images that cannot be used are skipped, listed in
    ``bad_files`` with the reason, and named in one warning: empty, cut-off header, cut off at the
    end (:func:`~simpletuner.data_backend.images.image_size_reader`), not an image, no permission, a
    file name that is not valid UTF-8, or a caption file that exists but cannot be read. Clips are
    bucketed by their first frame's size and skipped on the same grounds (a corrupt clip counts as a
    bad file).

    ``unreadable`` maps the paths a backend found but could not read before the scan (a
    staging backend's failures; they are not in its ``list_files``) to the reason; images
    among them count as bad files, caption files among them skip their image.

    Raises:
        ValueError: no image files (clips) under the root; no readable one; a larger fraction
            ``config.max_bad_image_fraction`` of the files or more unreadable; for video, clips with
            fewer frames than ``num_frames`` at ``frame_stride`` take (all named at once) or still
            images directly under the root.
        ImportError: a video dataset holds video files and PyAV is not installed.
    """
    unreadable = unreadable or {}
    root = _describe_root(backend, dataset_cfg)
    resolution = dataset_cfg.resolution or config.resolution
    geometry = geometry_for(dataset_cfg, config)
    is_video = getattr(dataset_cfg, "dataset_type", "image") == "video"
    if is_video:
        clips, failed, stray = find_clips(backend, unreadable)
        if stray:
            raise stray_images_error(backend.id, root, stray)
        if any(clip.media == VIDEO_FILE for clip in clips):
            require_av()  # before scanning: a missing extra is not a bad file
        paths, clip_of = [clip.path for clip in clips], clips
        needed = frames_needed(dataset_cfg.num_frames, dataset_cfg.frame_stride)
    else:
        paths, clip_of = backend.list_files(IMAGE_EXTENSIONS), repeat(None)  # no (path, None) pair per image
        failed = sorted(
            (display_path(p), f"cannot read file: {reason}")
            for p, reason in unreadable.items()
            if PurePosixPath(p).suffix.lower() in IMAGE_EXTENSIONS
        )
    if not paths and not failed:
        if is_video:
            raise ValueError(f"no clips found under {root} (looked for {CLIP_KINDS}, recursively)")
        raise ValueError(f"no images found under {root} (looked for .jpg, .jpeg, .png, .webp recursively)")

    noun = "clips" if is_video else "image files"
    result = DatasetMetadata(num_files=len(paths) + len(failed), bad_files=list(failed), noun=noun)
    caption_sources: Counter[str] = Counter()
    notes = CaptionNotes(backend.id)
    unique: list[Sample] = []
    too_short: list[tuple[str, int]] = []
    sizes = _SizeRules(dataset_cfg, resolution, config.max_bad_image_fraction, geometry)
    is_table = dataset_cfg.caption_strategy in METADATA_CAPTION_STRATEGIES
    table = load_caption_table(dataset_cfg, backend.id) if is_table else None  # before any image is read
    sources: dict[str, str] | None = None
    if has_sources(dataset_cfg):  # edit pairs: every image's source found (or refused) before any is read
        if is_video:
            raise ValueError(
                f"dataset {backend.id!r}: source images (conditioning_data_dir / conditioning_column) pair with still "
                "images only; this dataset is `dataset_type: video`. Remove the key, or use an image dataset"
            )
        sources = find_sources(dataset_cfg, paths, table)
    bad_pairs: list[tuple[str, str]] = []
    size_of = image_size_reader(backend)
    shared: dict[Any, Any] = {}  # one object for each distinct caption, size, bucket and canvas
    plans: dict[tuple[int, int], Any] = {}
    seedless = not (geometry.crop is True and geometry.crop_aspect == "random")
    scanning = tqdm(paths, desc=f"scanning {backend.id}", unit="clip" if is_video else "img", disable=None)
    for path, clip in zip(scanning, clip_of):
        fault_point("dataset:scan")  # tests: a signal in the middle of the scan
        shown, is_folder = (clip.display, clip.media == FRAME_FOLDER) if clip else (path, False)
        if not _is_utf8_name(path):
            # Sample keys, cache keys and file-name captions are UTF-8 text.
            result.bad_files.append((display_path(shown), "file name is not valid UTF-8; rename the file"))
            continue
        if table is not None and table.caption(path, is_folder=is_folder) is None:
            table.missing.append(shown)  # skipped, as SimpleTuner does; counted in table.report
            continue
        try:
            width, height, num_source = probe_clip(backend, clip) if clip else (*size_of(path), 1)
        except ValueError as exc:
            result.bad_files.append((shown, str(exc)))
            continue
        except OSError as exc:
            result.bad_files.append((shown, f"cannot read file: {exc.strerror or exc}"))
            continue
        if clip is not None and num_source < needed:
            too_short.append((shown, num_source))
            continue
        if table is not None:
            table.check_size(path, width, height, is_folder=is_folder)
        key = f"{backend.id}/{path}"
        crop_seed = crop_seed_for(seed, key)
        plan = plans.get((width, height)) if seedless else None
        if plan is None:
            plan = geometry.plan(width, height, crop_seed)
            if seedless:  # images of one size share a plan unless the seed draws their aspect
                plans[(width, height)] = plan
        if not sizes.keep(shown, width, height, plan.bucket):
            continue
        problem = _caption_problem(backend, path, dataset_cfg, unreadable, is_folder)
        if problem is None:
            try:
                captions, source = captions_for(backend, path, dataset_cfg, is_folder=is_folder, table=table)
            except OSError as exc:
                text_path = caption_file(path, is_folder=is_folder)
                problem = f"caption file {text_path} cannot be read: {exc.strerror or exc}"
        if problem is not None:
            result.bad_files.append((shown, problem))
            continue
        if sources is not None:
            pair_problem = aspect_problem((width, height), sources[path])
            if pair_problem is not None:
                bad_pairs.append((shown, pair_problem))
                continue
        caption_sources[source] += 1
        notes.add(path, shown, captions, source, is_folder)
        unique.append(
            Sample(
                key=key,
                dataset_id=backend.id,
                path=path,
                caption=shared.setdefault(captions[0], captions[0]),
                original_size=shared.setdefault((width, height), (width, height)),
                bucket=shared.setdefault(plan.bucket, plan.bucket),
                crop_style=dataset_cfg.crop_style,
                crop_seed=crop_seed,
                canvas=plan.canvas if plan.canvas is None else shared.setdefault(plan.canvas, plan.canvas),
                is_regularisation_data=dataset_cfg.is_regularisation_data,
                source=sources[path] if sources is not None else None,
                caption_lines=shared.setdefault(captions, captions) if len(captions) > 1 else (),
                **(_clip_fields(clip, dataset_cfg) if clip else {}),
            )
        )

    if table is not None:
        table.report(backend.id, root, result.num_files)
    if bad_pairs:
        raise ValueError(
            f"dataset {backend.id!r}: {len(bad_pairs)} edit pair(s) cannot be used:\n{format_bad(bad_pairs)}"
        )
    if too_short:
        raise too_short_error(
            backend.id, root, too_short, result.num_files, dataset_cfg.num_frames, dataset_cfg.frame_stride
        )
    check_bad_files(backend.id, root, result.num_files, result.bad_files, config.max_bad_image_fraction, noun)
    sizes.report(backend.id, root, result.num_files, noun, has_kept=bool(unique))
    result.num_skipped_small = sizes.num_skipped
    if not unique:
        raise ValueError(
            f"dataset {backend.id!r}: none of the {result.num_files} {noun} under {root} could be read:\n"
            f"{format_bad(result.bad_files)}\nfix or replace these files"
        )
    if dataset_cfg.caption_strategy == "textfile" and caption_sources["textfile"] < len(unique):
        logger.warning(
            "dataset %r: %d of %d %s have no (or an empty) caption .txt file; captioned from %s",
            backend.id,
            len(unique) - caption_sources["textfile"],
            len(unique),
            "clips" if is_video else "images",
            "instance_prompt" if dataset_cfg.instance_prompt else "the file name",
        )
    warn_skipped(backend.id, result.num_files, result.bad_files, "while scanning", noun)
    notes.report()
    repeats = getattr(dataset_cfg, "repeats", 0)
    result.samples = unique * (1 + repeats) if repeats else unique
    result.caption_sources = dict(caption_sources)
    return result


def _clip_fields(clip: Clip, dataset_cfg: Any) -> dict[str, Any]:
    """The ``Sample`` fields of a clip: its kind, frame count and stride, and a frame folder's frames."""
    num_frames, stride = dataset_cfg.num_frames, dataset_cfg.frame_stride
    frames = tuple(clip.frames[i] for i in frame_indices(num_frames, stride)) if clip.media == FRAME_FOLDER else ()
    return {"num_frames": num_frames, "frame_stride": stride, "media": clip.media, "frame_paths": frames}
