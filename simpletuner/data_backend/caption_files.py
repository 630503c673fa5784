"""Captions from a metadata file: ``caption_strategy`` ``parquet``, ``csv`` or ``jsonl``.

The file holds one row per image; ``filename_column`` names the image (its path under the dataset
root, without the extension unless ``identifier_includes_extension``) and ``caption_column`` its
caption (``fallback_caption_column`` where that is empty). The file is read once per scan into a
:class:`CaptionTable`; :func:`simpletuner.data_backend.metadata.build_metadata` asks it for each
image's caption, skips images it has none for and, after the scan, reports what did not match.

Parquet needs pyarrow (the ``parquet`` extra), imported only when a Parquet file is read.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from simpletuner.configuration.sections import metadata_file_format
from simpletuner.data_backend.base import ENCODED_MEDIA_EXTENSIONS

if TYPE_CHECKING:
    from simpletuner.configuration.dataset_sections import FolderDatasetConfig, MetadataFileOptions

logger = logging.getLogger(__name__)

#: Identifiers named in a warning or error message.
NUM_SHOWN = 10

Row = dict[str, Any]


def _shown(items: Iterable[str]) -> str:
    items = list(items)
    listed = ", ".join(items[:NUM_SHOWN])
    return listed + (f", ... ({len(items) - NUM_SHOWN} more)" if len(items) > NUM_SHOWN else "")


def strip_media_extension(name: str) -> str:
    """``"sub/cat.png"`` -> ``"sub/cat"``: an image or clip extension is dropped, any other dot is kept
    (``"2024.05.01_shot"`` stays whole)."""
    path = PurePosixPath(name)
    return path.with_suffix("").as_posix() if path.suffix.lower() in ENCODED_MEDIA_EXTENSIONS else name


def _identifier_text(value: Any) -> str | None:
    """A filename cell as text: numbers without a trailing ``.0``, paths with ``/``, None when empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    text = str(value).strip().replace("\\", "/")
    while text.startswith("./"):
        text = text[2:]
    return text or None


def _caption_texts(value: Any) -> list[str]:
    """The non-empty captions in a caption cell: a string, or a list of them (a multi-caption row)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return []
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if isinstance(value, (list, tuple)):
        return [text for item in value for text in _caption_texts(item)]
    text = str(value).strip()
    return [text] if text else []


# --- readers: each returns (column names, rows) --------------------------------------------------------------
def _read_parquet(path: Path, columns: list[str]) -> tuple[list[str], Iterator[Row]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            f"{path}: reading a Parquet caption file needs pyarrow: install the `parquet` extra "
            '(`pip install -e ".[parquet]"` in the simpletuner checkout, or `pip install pyarrow`)'
        ) from exc
    try:
        names = list(pq.read_schema(path).names)
    except (pa.ArrowException, OSError) as exc:  # ArrowInvalid: not a Parquet file
        raise ValueError(f"{path} is not a readable Parquet file ({exc}); check `path`") from exc
    table = pq.read_table(path, columns=[c for c in dict.fromkeys(columns) if c in names])
    return names, iter(table.to_pylist())


def _read_jsonl(path: Path, columns: list[str]) -> tuple[list[str], Iterator[Row]]:
    rows: list[Row] = []
    with open(path, encoding="utf-8-sig") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {number}: not valid JSON ({exc.msg}); one JSON object a line") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return _union_of_keys(rows), iter(rows)


def _read_json(path: Path, columns: list[str]) -> tuple[list[str], Iterator[Row]]:
    with open(path, encoding="utf-8-sig") as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise ValueError(f"{path}: a .json caption file must hold one JSON array of objects (a row each)")
    return _union_of_keys(data), iter(data)


def _read_csv(path: Path, columns: list[str]) -> tuple[list[str], Iterator[Row]]:
    text = path.read_bytes().decode("utf-8-sig", errors="strict")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    names = list(reader.fieldnames or [])
    if not names:
        raise ValueError(f"{path}: the CSV file is empty; its first line must name the columns")
    return names, iter(reader)


def _union_of_keys(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(key for row in rows for key in row))


_READERS = {"parquet": _read_parquet, "jsonl": _read_jsonl, "json": _read_json, "csv": _read_csv}


@dataclass
class CaptionTable:
    """The captions of one metadata file, by image identifier, and what the scan matched against them."""

    source: str  # the file, for messages
    strategy: str  # parquet | csv | jsonl
    filename_column: str
    identifier_includes_extension: bool
    captions: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    num_rows: int = 0
    num_multi: int = 0  # rows holding several captions (the first is used)
    duplicates: list[str] = field(default_factory=list)  # identifiers on more than one row (the last wins)
    matched: set[str] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)  # images of the dataset with no caption here
    resized: list[str] = field(default_factory=list)  # images whose header size differs from the table's
    #: ``conditioning_column``: image identifier -> its source image as written in the row (edit pairs).
    sources: dict[str, str] = field(default_factory=dict)

    def identifier(self, path: str, *, is_folder: bool = False) -> str:
        """The identifier the file uses for the image (clip, frame folder) at ``path`` under the root."""
        return path if self.identifier_includes_extension or is_folder else strip_media_extension(path)

    def caption(self, path: str, *, is_folder: bool = False) -> str | None:
        """The caption of ``path``, or None when the file has no (non-empty) caption for it."""
        key = self.identifier(path, is_folder=is_folder)
        caption = self.captions.get(key)
        if caption is not None:
            self.matched.add(key)
        return caption

    def check_size(self, path: str, width: int, height: int, *, is_folder: bool = False) -> None:
        """Count ``path`` when the table's width/height columns give another size (either orientation
        agrees: an EXIF rotation is not a mismatch)."""
        size = self.sizes.get(self.identifier(path, is_folder=is_folder))
        if size is not None and size not in ((width, height), (height, width)):
            self.resized.append(f"{path} ({width}x{height}, the table says {size[0]}x{size[1]})")

    def report(self, dataset_id: str, root: str, num_files: int) -> None:
        """After the scan: stop when no image matched a row, else one warning per kind of mismatch."""
        where = f"dataset {dataset_id!r}: {self.strategy} file {self.source}"
        if not self.matched and self.missing:
            example_id = next(iter(self.captions), None)
            raise ValueError(
                f"{where}: none of the {len(self.missing)} files under {root} has a caption there "
                f"(looked up by `{self.filename_column}`: e.g. {self.missing[0]!r}"
                + (f"; the file names rows like {example_id!r}" if example_id is not None else "; it has no captions")
                + "). Check `filename_column` and `identifier_includes_extension`, and that the values are paths "
                "relative to `instance_data_dir`"
            )
        if self.missing:
            logger.warning(
                "%s: skipped %d of %d files with no caption there (no row, or an empty caption): %s",
                where,
                len(self.missing),
                num_files,
                _shown(self.missing),
            )
        unmatched = [key for key in self.captions if key not in self.matched]
        if unmatched:
            logger.warning(
                "%s: %d of %d captioned rows name no file under %s (not found, or skipped by the scan): %s",
                where,
                len(unmatched),
                len(self.captions),
                root,
                _shown(unmatched),
            )
        if self.duplicates:
            logger.warning(
                "%s: %d file name(s) appear on more than one row; the last row's caption is used: %s",
                where,
                len(self.duplicates),
                _shown(self.duplicates),
            )
        if self.num_multi:
            logger.warning(
                "%s: %d row(s) hold several captions; the first is used (one caption per image)",
                where,
                self.num_multi,
            )
        if self.resized:
            logger.warning(
                "%s: %d image(s) have another size than the width/height columns say; the image's own size is used: %s",
                where,
                len(self.resized),
                _shown(self.resized),
            )


def metadata_options(dataset_cfg: FolderDatasetConfig) -> MetadataFileOptions | None:
    """The ``parquet`` / ``csv`` / ``jsonl`` section the dataset's ``caption_strategy`` reads; None for
    another strategy (or the section unset)."""
    tables = {"parquet": dataset_cfg.parquet, "csv": dataset_cfg.csv, "jsonl": dataset_cfg.jsonl}
    return tables.get(dataset_cfg.caption_strategy)


def load_caption_table(dataset_cfg: FolderDatasetConfig, dataset_id: str | None = None) -> CaptionTable:  # noqa: C901, PLR0915
    """Read the metadata file of ``dataset_cfg``'s ``parquet`` / ``csv`` / ``jsonl`` caption strategy.

    Raises:
        ValueError: the file is missing or unreadable, or lacks a named column (the message lists the
            columns it has).
        ImportError: a Parquet file and no pyarrow.
    """
    strategy = dataset_cfg.caption_strategy
    options = metadata_options(dataset_cfg)
    assert options is not None, f"caption_strategy {strategy!r} reads no metadata file"  # the config's rules
    dataset_id = dataset_id or dataset_cfg.id
    path = Path(options.path).expanduser()
    where = f"dataset {dataset_id!r}: {strategy}.path {path}"
    if not path.is_file():
        raise ValueError(f"{where} is not a file; give the {strategy} file of captions")
    wanted = {
        "filename_column": options.filename_column,
        "caption_column": options.caption_column,
        "fallback_caption_column": options.fallback_caption_column,
        "width_column": options.width_column,
        "height_column": options.height_column,
        "conditioning_column": options.conditioning_column,
    }
    named = {key: column for key, column in wanted.items() if column is not None}
    if (options.width_column is None) != (options.height_column is None):
        raise ValueError(
            f"dataset {dataset_id!r}: {strategy}: give both `width_column` and `height_column`, or neither"
        )
    file_format = metadata_file_format(strategy, options.path)
    try:
        names, rows = _READERS[file_format](path, list(named.values()))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from exc
    except OSError as exc:
        raise ValueError(f"{where} cannot be read: {exc.strerror or exc}") from exc
    absent = [f"{column!r} (`{strategy}.{key}`)" for key, column in named.items() if column not in names]
    if absent:
        raise ValueError(
            f"{where} has no column {' or '.join(absent)}; its columns are: {', '.join(map(repr, names)) or 'none'}. "
            "Name one of those"
        )
    table = CaptionTable(str(path), strategy, options.filename_column, options.identifier_includes_extension)
    seen: set[str] = set()
    for row in rows:
        table.num_rows += 1
        key = _identifier_text(row.get(options.filename_column))
        if key is None:
            continue
        if not options.identifier_includes_extension:
            key = strip_media_extension(key)
        captions = _caption_texts(row.get(options.caption_column))
        if not captions and options.fallback_caption_column is not None:
            captions = _caption_texts(row.get(options.fallback_caption_column))
        if key in seen:
            table.duplicates.append(key)
        seen.add(key)
        if options.conditioning_column is not None:
            source = _identifier_text(row.get(options.conditioning_column))
            if source is not None:
                table.sources[key] = source
            else:
                table.sources.pop(key, None)  # the last row wins, as for captions
        if options.width_column is not None and options.height_column is not None:  # both or neither (above)
            size = _size(row.get(options.width_column), row.get(options.height_column))
            if size is not None:
                table.sizes[key] = size
        if not captions:
            table.captions.pop(key, None)  # a later empty row replaces an earlier caption, as the last row wins
            continue
        table.num_multi += len(captions) > 1
        table.captions[key] = captions[0]
    return table


def _size(width: Any, height: Any) -> tuple[int, int] | None:
    """``(width, height)`` from two cells (numbers or their text), None when either is not a number."""
    try:
        return int(float(str(width).strip())), int(float(str(height).strip()))
    except (TypeError, ValueError, OverflowError):
        return None
