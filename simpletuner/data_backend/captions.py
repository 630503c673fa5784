"""Captions: where each image's caption comes from (``caption_strategy``), a caption file's lines, and
which line a multi-line caption trains with at each draw.

Meanings are SimpleTuner's (``simpletuner/helpers/prompts.py`` at bc8e6ab7): ``filename`` is the stem with
``_`` as a space (:func:`caption_from_filename`; the older cleaning is ``filename_cleaned``); a caption file
of several lines is one caption per stripped, non-empty line unless ``disable_multiline_split``, and
:func:`caption_line_index` picks one per draw as a pure function of seed, draw and sample. Source lines and
where this differs: documentation/DATA_SOURCES.md, "Captions: SimpleTuner's meanings".
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from simpletuner.configuration.sections import METADATA_CAPTION_STRATEGIES
from simpletuner.data_backend.base import DataBackend
from simpletuner.data_backend.caption_files import CaptionTable, load_caption_table
from simpletuner.data_backend.caption_shuffle import is_shuffling, shuffled_captions

if TYPE_CHECKING:
    from simpletuner.configuration.dataset_sections import FolderDatasetConfig

logger = logging.getLogger("simpletuner.data_backend.metadata")  # the scan's messages, under the scan's name

_TRAILING_NUMBER = re.compile(r"(?:[\s_\-]+\d+)+$")


def _stem(path: str, is_folder: bool) -> str:
    """``PurePosixPath(path).stem`` (a folder: its ``name``), without building a path object for a plain path."""
    if "//" in path or "./" in path or path.endswith("/"):
        return PurePosixPath(path).name if is_folder else PurePosixPath(path).stem
    stem = path[path.rfind("/") + 1 :]
    dot = stem.rfind(".")
    return stem[:dot] if not is_folder and 0 < dot < len(stem) - 1 else stem


def caption_from_filename(path: str, *, is_folder: bool = False) -> str:
    """``caption_strategy: filename``, as SimpleTuner gives it: the file's stem with each ``_`` a space
    and nothing else changed (``"IMG_2031.jpg"`` -> ``"IMG 2031"``, ``"red_cat-on_mat_001.png"`` ->
    ``"red cat-on mat 001"``). A frame folder keeps its whole name (``_`` as spaces)."""
    return _stem(path, is_folder).replace("_", " ")


def caption_from_filename_cleaned(path: str, *, is_folder: bool = False) -> str:
    """``caption_strategy: filename_cleaned``: ``"photos/red_cat-on_mat_001.png"`` -> ``"red cat on mat"``.

    Underscores and dashes become spaces, runs of spaces one, and a trailing number (``_001``, ``-12``) is
    dropped; a name that is only a number keeps it. A folder (a frame folder) keeps its whole name.
    """
    stem = _stem(path, is_folder)
    trimmed = _TRAILING_NUMBER.sub("", stem) or stem
    return " ".join(trimmed.replace("_", " ").replace("-", " ").split())


def caption_lines(text: str) -> list[str]:
    """The captions of a caption file's ``text`` split at line breaks: each line stripped, empty ones dropped
    (SimpleTuner splits at ``\\n`` and its caption cache strips each line and drops empty ones)."""
    return [line for line in (part.strip() for part in text.split("\n")) if line]


def caption_line_index(seed: int, epoch: int, position: int, slot: int, key: str, num_lines: int) -> int:
    """Which of a sample's ``num_lines`` captions it trains with when drawn at ``slot`` of micro-batch
    ``position`` of ``epoch``: uniform, from sha256 of those values, the run's ``seed`` and the sample
    ``key`` (the same coordinates caption dropout draws from, under another tag, so the two are independent)."""
    if num_lines <= 1:
        return 0
    text = f"caption-line\x00{seed}\x00{epoch}\x00{position}\x00{slot}\x00{key}"
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") % num_lines


def _decode_caption(data: bytes, where: str) -> str:
    """UTF-8 (a BOM is dropped), or UTF-16 when the file starts with a UTF-16 BOM (what
    Windows Notepad writes as "Unicode"). Anything else that is not valid UTF-8 is decoded with
    undecodable bytes replaced by U+FFFD, and a warning names the file: guessing a legacy
    code page (latin-1, cp1252, shift-jis) would turn the bytes into confident nonsense."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError:
            pass  # a UTF-8/latin-1 file that merely starts with those two bytes
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        logger.warning(
            "caption file %s is not valid UTF-8 (%s at byte %d); undecodable bytes were replaced with U+FFFD. "
            "Re-save it as UTF-8 to keep those characters",
            where,
            exc.reason,
            exc.start,
        )
        return data.decode("utf-8", errors="replace")


def caption_file(path: str, *, is_folder: bool = False) -> str:
    """The caption file of the image or clip file at ``path`` (``a/b.png`` -> ``a/b.txt``), or of
    the frame folder ``path`` (``a/clip`` -> ``a/clip.txt``, next to the folder)."""
    slash, dot = path.rfind("/"), path.rfind(".")
    if is_folder:
        return f"{path}.txt"
    if 0 < dot - slash - 1 < len(path) - slash - 2 and "//" not in path and "./" not in path:
        return f"{path[:dot]}.txt"  # what pathlib gives below, for a plain path
    return PurePosixPath(path).with_suffix(".txt").as_posix()


def captions_for(
    backend: DataBackend,
    path: str,
    dataset_cfg: FolderDatasetConfig,
    *,
    is_folder: bool = False,
    table: CaptionTable | None = None,
    seed: int = 0,
) -> tuple[tuple[str, ...], str]:
    """The captions of the image (or clip, or frame folder when ``is_folder``) at ``path`` and where they came
    from: one caption, or a caption file's lines (:func:`caption_lines`) unless ``disable_multiline_split``;
    with ``caption_shuffle`` each followed by its shuffled copies
    (:func:`~simpletuner.data_backend.caption_shuffle.shuffled_captions`, from ``seed`` unless it sets its own),
    except under ``caption_strategy: instance_prompt`` (as SimpleTuner).

    ``caption_strategy``: ``textfile`` (:func:`caption_file`, falling back to ``instance_prompt``, then
    :func:`caption_from_filename_cleaned`); ``filename`` / ``filename_cleaned``; ``instance_prompt``;
    ``parquet`` / ``csv`` / ``jsonl`` (the row of ``path`` in ``table``, read here when not given). With
    ``prepend_instance_prompt``, ``instance_prompt`` and a space go before every caption (each line) that did
    not come from ``instance_prompt`` itself.

    Raises:
        ValueError: a metadata strategy has no caption for ``path``.
    """
    caption, source = _own_caption(backend, path, dataset_cfg, is_folder, table)
    captions: tuple[str, ...] = (caption,)
    if source == "textfile" and not dataset_cfg.disable_multiline_split and "\n" in caption:
        captions = tuple(caption_lines(caption))
    shuffle = dataset_cfg.caption_shuffle
    if shuffle is not None and is_shuffling(shuffle) and dataset_cfg.caption_strategy != "instance_prompt":
        captions = tuple(copy for c in captions for copy in shuffled_captions(c, shuffle, seed))
    if dataset_cfg.prepend_instance_prompt and source != "instance_prompt":
        captions = tuple(f"{dataset_cfg.instance_prompt} {c}" for c in captions)
    return captions, source


def caption_for(
    backend: DataBackend,
    path: str,
    dataset_cfg: FolderDatasetConfig,
    *,
    is_folder: bool = False,
    table: CaptionTable | None = None,
) -> tuple[str, str]:
    """:func:`captions_for` as one text: ``(caption, source)``, several lines joined by ``\\n``."""
    captions, source = captions_for(backend, path, dataset_cfg, is_folder=is_folder, table=table)
    return "\n".join(captions), source


def _own_caption(
    backend: DataBackend, path: str, dataset_cfg: FolderDatasetConfig, is_folder: bool, table: CaptionTable | None
) -> tuple[str, str]:
    """:func:`captions_for` before splitting and ``prepend_instance_prompt``."""
    strategy = dataset_cfg.caption_strategy
    if strategy in METADATA_CAPTION_STRATEGIES:
        table = table if table is not None else load_caption_table(dataset_cfg, backend.id)
        caption = table.caption(path, is_folder=is_folder)
        if caption is None:
            raise ValueError(
                f"dataset {backend.id!r}: {strategy} file {table.source} has no caption for {path!r} "
                f"(looked up as {table.identifier(path, is_folder=is_folder)!r} in `{table.filename_column}`)"
            )
        return caption, strategy
    if strategy == "textfile":
        text_path = caption_file(path, is_folder=is_folder)
        if backend.exists(text_path):
            caption = _decode_caption(backend.read(text_path), f"{backend.id}/{text_path}").strip()
            if caption:
                return caption, "textfile"
        if dataset_cfg.instance_prompt:
            return dataset_cfg.instance_prompt, "instance_prompt"
        return caption_from_filename_cleaned(path, is_folder=is_folder), "filename_cleaned"
    if strategy == "filename":
        return caption_from_filename(path, is_folder=is_folder), "filename"
    if strategy == "filename_cleaned":
        return caption_from_filename_cleaned(path, is_folder=is_folder), "filename_cleaned"
    if strategy == "instance_prompt":
        if not dataset_cfg.instance_prompt:
            raise ValueError(
                f"dataset {backend.id!r}: caption_strategy 'instance_prompt' needs `instance_prompt`; "
                "add the caption every image should get"
            )
        return dataset_cfg.instance_prompt, "instance_prompt"
    raise ValueError(
        f"dataset {backend.id!r}: unknown caption_strategy {strategy!r}; use textfile, filename, filename_cleaned, "
        "instance_prompt, parquet, csv or jsonl"
    )


@dataclass
class CaptionNotes:
    """What the scan says once per dataset about its captions, where SimpleTuner's meaning is easy to miss:
    caption files of several lines (one line per draw) and ``filename`` captions that differ from
    ``filename_cleaned`` (this trainer's ``filename`` before it took SimpleTuner's meaning)."""

    dataset_id: str
    shuffles: bool = False  # `caption_shuffle` makes copies: several captions are not several lines
    num_multiline: int = 0
    multiline_example: str | None = None
    num_filename_kept: int = 0  # `filename` captions that `filename_cleaned` would change
    filename_example: tuple[str, str, str] | None = None  # (file, caption, cleaned caption)
    num_captions: int = 0
    num_shuffled: int = 0  # captions drawn from, copies included, with `caption_shuffle`

    def add(self, path: str, shown: str, captions: tuple[str, ...], source: str, is_folder: bool = False) -> None:
        """Count one scanned image (clip) whose captions are ``captions`` (from ``source``)."""
        self.num_captions += 1
        if self.shuffles:
            self.num_shuffled += len(captions)
        elif len(captions) > 1:
            self.num_multiline += 1
            if self.multiline_example is None:
                self.multiline_example = f"{caption_file(shown, is_folder=is_folder)} ({len(captions)} lines)"
        if source == "filename":
            plain = caption_from_filename(path, is_folder=is_folder)
            cleaned = caption_from_filename_cleaned(path, is_folder=is_folder)
            if plain != cleaned:
                self.num_filename_kept += 1
                if self.filename_example is None:
                    self.filename_example = (shown, plain, cleaned)

    def report(self) -> None:
        """One INFO line per note that applies to this dataset."""
        if self.shuffles:
            logger.info(
                "dataset %r: caption_shuffle: %d images have %d captions in all, each caption followed by its shuffled "
                "copies; each is encoded once and every draw of an image trains on one of them, chosen from the seed "
                '(kohya shuffles anew at every use; see documentation/DATA_SOURCES.md, "Caption shuffling")',
                self.dataset_id,
                self.num_captions,
                self.num_shuffled,
            )
        if self.num_multiline:
            logger.info(
                "dataset %r: %d of %d caption files have several lines (e.g. %s): each line is a caption of its "
                "own and every draw of the image trains on one of them, chosen from the seed (as SimpleTuner "
                "does); `disable_multiline_split: true` keeps each file whole as one caption",
                self.dataset_id,
                self.num_multiline,
                self.num_captions,
                self.multiline_example,
            )
        if self.num_filename_kept and self.filename_example is not None:
            shown, plain, cleaned = self.filename_example
            logger.info(
                "dataset %r: caption_strategy `filename` takes the file name as it is, `_` as spaces (as SimpleTuner "
                "does): %d of %d captions keep a `-`, a trailing number or repeated spaces, e.g. %s -> %r; "
                "`caption_strategy: filename_cleaned` gives the earlier text (%r)",
                self.dataset_id,
                self.num_filename_kept,
                self.num_captions,
                shown,
                plain,
                cleaned,
            )
