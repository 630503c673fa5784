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
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from tqdm.auto import tqdm

from simpletuner.configuration.sections import METADATA_CAPTION_STRATEGIES
from simpletuner.data_backend.bad_files import check_bad_files, format_bad, report_after_fill, warn_skipped
from simpletuner.data_backend.base import IMAGE_EXTENSIONS, DataBackend
from simpletuner.data_backend.caption_files import load_caption_table
from simpletuner.data_backend.caption_shuffle import is_shuffling
from simpletuner.data_backend.captions import CaptionNotes, caption_file, captions_for
from simpletuner.data_backend.captions import caption_for as caption_for
from simpletuner.data_backend.captions import caption_from_filename as caption_from_filename
from simpletuner.data_backend.captions import caption_from_filename_cleaned as caption_from_filename_cleaned
from simpletuner.data_backend.generated_conditioning import generate_conditioning
from simpletuner.data_backend.geometry import CropPlan, Geometry, geometry_for
from simpletuner.data_backend.images import image_size_reader
from simpletuner.data_backend.masks import find_masks, has_masks
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
    from simpletuner.configuration.dataset_sections import FolderDatasetConfig

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
    #: Masked loss: the absolute path of the sample's mask (:mod:`simpletuner.data_backend.masks`), or None.
    mask: str | None = None
    #: How the mask weights the loss (the dataset's ``mask_type``): ``mask`` or ``segmentation``.
    mask_type: str = "mask"

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
    backend: DataBackend,
    path: str,
    dataset_cfg: FolderDatasetConfig,
    unreadable: Mapping[str, str],
    is_folder: bool = False,
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


def _describe_root(backend: DataBackend, dataset_cfg: FolderDatasetConfig) -> str:
    root = getattr(backend, "root", None) or dataset_cfg.instance_data_dir  # not every backend has a root folder
    return str(root) if root is not None else f"dataset {backend.id!r}"


def build_metadata(
    backend: DataBackend,
    dataset_cfg: FolderDatasetConfig,
    config: "TrainingConfig",
    seed: int,
    unreadable: Mapping[str, str] | None = None,
) -> DatasetMetadata:
    """Scan ``backend`` for images (clips for ``dataset_type: video``) and give each a caption, size,
    bucket and crop seed, at ``dataset_cfg.resolution`` or ``config.resolution``.

    Unusable files (empty, cut off, not an image, unreadable caption, corrupt clip, ...) are skipped, listed in
    ``bad_files`` and named in one warning; ``unreadable`` maps paths the backend could not read before the scan
    to the reason (images among them are bad files, caption files skip their image). Raises ValueError when
    nothing is readable, ``max_bad_image_fraction`` or more is unreadable, or (video) clips are too short for
    ``num_frames`` at ``frame_stride`` or still images stray in; ImportError for video files without PyAV.
    """
    unreadable = unreadable or {}
    root = _describe_root(backend, dataset_cfg)
    geometry = geometry_for(dataset_cfg, config)
    listing = _list_media(backend, dataset_cfg, root, unreadable)
    if dataset_cfg.conditioning is not None and not listing.is_video:  # video: refused by the config's rules
        listing.generated, failed = generate_conditioning(backend, dataset_cfg, config, listing.paths)
        if failed:  # unreadable images: bad files, as the scan would have found them
            listing.paths = [path for path in listing.paths if path not in failed]
            listing.failed = sorted([*listing.failed, *((display_path(p), why) for p, why in failed.items())])
    scan = _Scan(backend, dataset_cfg, config, seed, unreadable, listing, geometry, root)
    scanning = tqdm(listing.paths, desc=f"scanning {backend.id}", unit=scan.unit, disable=None)
    for path, clip in zip(scanning, listing.clips):
        fault_point("dataset:scan")  # tests: a signal in the middle of the scan
        scan.add(path, clip)
    return scan.finish()


@dataclass
class _Listing:
    """What a scan walks: the paths, each one's clip (video), the files known bad before it, frames a clip needs."""

    paths: list[str]
    clips: Iterable[Clip | None]
    failed: list[tuple[str, str]]
    is_video: bool
    num_frames: int = 1  # a clip's frames per sample (video)
    needed: int = 1  # the source frames that takes at `frame_stride`
    generated: Path | None = None  # the folder of the generated conditioning images (`conditioning`)


def _list_media(
    backend: DataBackend, dataset_cfg: FolderDatasetConfig, root: str, unreadable: Mapping[str, str]
) -> _Listing:
    """The images (or clips) under ``backend``'s root; stops the run when there is nothing to scan."""
    if dataset_cfg.dataset_type == "video":
        clips, failed, stray = find_clips(backend, unreadable)
        if stray:
            raise stray_images_error(backend.id, root, stray)
        if any(clip.media == VIDEO_FILE for clip in clips):
            require_av()  # before scanning: a missing extra is not a bad file
        num_frames = dataset_cfg.num_frames
        assert num_frames is not None  # the config's rules require it for video
        needed = frames_needed(num_frames, dataset_cfg.frame_stride)
        listing = _Listing([clip.path for clip in clips], clips, failed, True, num_frames, needed)
    else:
        failed = sorted(
            (display_path(p), f"cannot read file: {reason}")
            for p, reason in unreadable.items()
            if PurePosixPath(p).suffix.lower() in IMAGE_EXTENSIONS
        )
        # repeat(None): no (path, None) pair per image
        listing = _Listing(backend.list_files(IMAGE_EXTENSIONS), repeat(None), failed, is_video=False)
    if not listing.paths and not listing.failed:
        if listing.is_video:
            raise ValueError(f"no clips found under {root} (looked for {CLIP_KINDS}, recursively)")
        raise ValueError(f"no images found under {root} (looked for .jpg, .jpeg, .png, .webp recursively)")
    return listing


class _Scan:
    """One pass over a dataset's files: :meth:`add` turns each into a :class:`Sample` or records why it
    was left out; :meth:`finish` applies the dataset-wide checks and returns the metadata."""

    def __init__(
        self,
        backend: DataBackend,
        dataset_cfg: FolderDatasetConfig,
        config: "TrainingConfig",
        seed: int,
        unreadable: Mapping[str, str],
        listing: _Listing,
        geometry: Geometry,
        root: str,
    ):
        self.backend, self.dataset_cfg, self.config, self.seed = backend, dataset_cfg, config, seed
        self.unreadable, self.listing, self.geometry, self.root = unreadable, listing, geometry, root
        self.noun = "clips" if listing.is_video else "image files"
        self.unit = "clip" if listing.is_video else "img"
        self.result = DatasetMetadata(
            num_files=len(listing.paths) + len(listing.failed), bad_files=list(listing.failed), noun=self.noun
        )
        self.caption_sources: Counter[str] = Counter()
        self.notes = CaptionNotes(backend.id, shuffles=is_shuffling(dataset_cfg.caption_shuffle))
        self.unique: list[Sample] = []
        self.too_short: list[tuple[str, int]] = []
        self.bad_pairs: list[tuple[str, str]] = []
        resolution = dataset_cfg.resolution or config.resolution
        self.sizes = _SizeRules(dataset_cfg, resolution, config.max_bad_image_fraction, geometry)
        is_table = dataset_cfg.caption_strategy in METADATA_CAPTION_STRATEGIES
        self.table = load_caption_table(dataset_cfg, backend.id) if is_table else None  # before any image is read
        self.sources = self._find_sources()
        self.masks = self._find_masks()
        self.size_of = image_size_reader(backend)
        self.shared: dict[Any, Any] = {}  # one object for each distinct caption, size, bucket and canvas
        self.plans: dict[tuple[int, int], CropPlan] = {}
        # images of one size share a plan unless the seed draws their aspect
        self.seedless = not (geometry.crop is True and geometry.crop_aspect == "random")

    def _find_sources(self) -> dict[str, str] | None:
        """Edit pairs: every image's source found (or refused) before any is read; None without pairs."""
        if not has_sources(self.dataset_cfg):
            return None
        if self.listing.is_video:
            raise ValueError(
                f"dataset {self.backend.id!r}: source images (conditioning_data_dir / conditioning_column) pair with "
                "still images only; this dataset is `dataset_type: video`. Remove the key, or use an image dataset"
            )
        return find_sources(self.dataset_cfg, self.listing.paths, self.table, root=self.listing.generated)

    def _find_masks(self) -> dict[str, str] | None:
        """Masked loss: every image's mask found (or the images without one named) before any is read."""
        if not has_masks(self.dataset_cfg):
            return None
        return find_masks(self.dataset_cfg, self.listing.paths)

    def add(self, path: str, clip: Clip | None) -> None:
        """Scan one file: its name, caption row, size, frame count, size rules, caption and pair, in that order."""
        shown, is_folder = (clip.display, clip.media == FRAME_FOLDER) if clip else (path, False)
        if not _is_utf8_name(path):
            # Sample keys, cache keys and file-name captions are UTF-8 text.
            self.result.bad_files.append((display_path(shown), "file name is not valid UTF-8; rename the file"))
            return
        if self.table is not None and self.table.caption(path, is_folder=is_folder) is None:
            self.table.missing.append(shown)  # skipped, as SimpleTuner does; counted in table.report
            return
        probed = self._probe(path, clip, shown)
        if probed is None:
            return
        width, height = probed
        if self.table is not None:
            self.table.check_size(path, width, height, is_folder=is_folder)
        key = f"{self.backend.id}/{path}"
        crop_seed = crop_seed_for(self.seed, key)
        plan = self._plan(width, height, crop_seed)
        if not self.sizes.keep(shown, width, height, plan.bucket):
            return
        found = self._captions(path, shown, is_folder)
        if found is None:
            return
        captions, caption_source = found
        if self.sources is not None:
            pair_problem = aspect_problem((width, height), self.sources[path])
            if pair_problem is not None:
                self.bad_pairs.append((shown, pair_problem))
                return
        if self.masks is not None:
            mask_problem = aspect_problem((width, height), self.masks[path], "mask")
            if mask_problem is not None:
                self.bad_pairs.append((shown, mask_problem))
                return
        self.caption_sources[caption_source] += 1
        self.notes.add(path, shown, captions, caption_source, is_folder)
        self.unique.append(self._sample(key, path, clip, (width, height), plan, crop_seed, captions))

    def _probe(self, path: str, clip: Clip | None, shown: str) -> tuple[int, int] | None:
        """``(width, height)`` of a usable file; None when it is a bad file or a clip too short."""
        try:
            width, height, num_source = probe_clip(self.backend, clip) if clip else (*self.size_of(path), 1)
        except ValueError as exc:
            self.result.bad_files.append((shown, str(exc)))
            return None
        except OSError as exc:
            self.result.bad_files.append((shown, f"cannot read file: {exc.strerror or exc}"))
            return None
        if clip is not None and num_source < self.listing.needed:
            self.too_short.append((shown, num_source))
            return None
        return width, height

    def _plan(self, width: int, height: int, crop_seed: int) -> CropPlan:
        plan = self.plans.get((width, height)) if self.seedless else None
        if plan is None:
            plan = self.geometry.plan(width, height, crop_seed)
            if self.seedless:
                self.plans[(width, height)] = plan
        return plan

    def _captions(self, path: str, shown: str, is_folder: bool) -> tuple[tuple[str, ...], str] | None:
        """The file's captions and their source; None (recorded as a bad file) when its caption file is unreadable."""
        problem = _caption_problem(self.backend, path, self.dataset_cfg, self.unreadable, is_folder)
        if problem is None:
            try:
                return captions_for(
                    self.backend, path, self.dataset_cfg, is_folder=is_folder, table=self.table, seed=self.seed
                )
            except OSError as exc:
                text_path = caption_file(path, is_folder=is_folder)
                problem = f"caption file {text_path} cannot be read: {exc.strerror or exc}"
        self.result.bad_files.append((shown, problem))
        return None

    def _sample(
        self,
        key: str,
        path: str,
        clip: Clip | None,
        size: tuple[int, int],
        plan: CropPlan,
        crop_seed: int,
        captions: tuple[str, ...],
    ) -> Sample:
        shared, dataset_cfg = self.shared, self.dataset_cfg
        return Sample(
            key=key,
            dataset_id=self.backend.id,
            path=path,
            caption=shared.setdefault(captions[0], captions[0]),
            original_size=shared.setdefault(size, size),
            bucket=shared.setdefault(plan.bucket, plan.bucket),
            crop_style=dataset_cfg.crop_style,
            crop_seed=crop_seed,
            canvas=plan.canvas if plan.canvas is None else shared.setdefault(plan.canvas, plan.canvas),
            is_regularisation_data=dataset_cfg.is_regularisation_data,
            source=self.sources[path] if self.sources is not None else None,
            mask=self.masks[path] if self.masks is not None else None,
            mask_type=dataset_cfg.mask_type or "mask",
            caption_lines=shared.setdefault(captions, captions) if len(captions) > 1 else (),
            **(_clip_fields(clip, self.listing.num_frames, dataset_cfg.frame_stride) if clip else {}),
        )

    def finish(self) -> DatasetMetadata:
        """Report and check what the scan found, in order: caption table, edit pairs, short clips, bad
        files, size rules, captions; the samples repeated ``1 + repeats`` times."""
        backend_id, root, result, noun, unique = self.backend.id, self.root, self.result, self.noun, self.unique
        dataset_cfg = self.dataset_cfg
        if self.table is not None:
            self.table.report(backend_id, root, result.num_files)
        if self.bad_pairs:
            noun = "edit pair(s)" if self.sources is not None else "image(s) with masks"
            raise ValueError(
                f"dataset {backend_id!r}: {len(self.bad_pairs)} {noun} cannot be used:\n{format_bad(self.bad_pairs)}"
            )
        if self.too_short:
            raise too_short_error(
                backend_id, root, self.too_short, result.num_files, self.listing.num_frames, dataset_cfg.frame_stride
            )
        check_bad_files(backend_id, root, result.num_files, result.bad_files, self.config.max_bad_image_fraction, noun)
        self.sizes.report(backend_id, root, result.num_files, noun, has_kept=bool(unique))
        result.num_skipped_small = self.sizes.num_skipped
        if not unique:
            raise ValueError(
                f"dataset {backend_id!r}: none of the {result.num_files} {noun} under {root} could be read:\n"
                f"{format_bad(result.bad_files)}\nfix or replace these files"
            )
        self._warn_missing_textfiles()
        warn_skipped(backend_id, result.num_files, result.bad_files, "while scanning", noun)
        self.notes.report()
        repeats = dataset_cfg.repeats
        result.samples = unique * (1 + repeats) if repeats else unique
        result.caption_sources = dict(self.caption_sources)
        return result

    def _warn_missing_textfiles(self) -> None:
        textfiles, num_unique = self.caption_sources["textfile"], len(self.unique)
        if self.dataset_cfg.caption_strategy == "textfile" and textfiles < num_unique:
            logger.warning(
                "dataset %r: %d of %d %s have no (or an empty) caption .txt file; captioned from %s",
                self.backend.id,
                num_unique - textfiles,
                num_unique,
                "clips" if self.listing.is_video else "images",
                "instance_prompt" if self.dataset_cfg.instance_prompt else "the file name",
            )


def _clip_fields(clip: Clip, num_frames: int, stride: int) -> dict[str, Any]:
    """The ``Sample`` fields of a clip: its kind, frame count and stride, and a frame folder's frames."""
    frames = tuple(clip.frames[i] for i in frame_indices(num_frames, stride)) if clip.media == FRAME_FOLDER else ()
    return {"num_frames": num_frames, "frame_stride": stride, "media": clip.media, "frame_paths": frames}
