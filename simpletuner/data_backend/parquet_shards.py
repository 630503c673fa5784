"""Parquet files of image bytes and captions (as Hugging Face ``datasets`` stores them), read in place:
one row per image, a row group read once when rows are read in order. The virtual paths, caption files
and shard-major order are those of :mod:`simpletuner.data_backend.shards`."""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Sequence

from simpletuner.data_backend.base import IMAGE_EXTENSIONS
from simpletuner.data_backend.captions import caption_file
from simpletuner.data_backend.shards import ROW_GROUP_CACHE_SIZE, _Entry, _ShardBackend

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.configuration.dataset_sections import HuggingFaceDatasetConfig, ParquetDatasetConfig

logger = logging.getLogger(__name__)


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            'a `type: "parquet"` dataset needs pyarrow: install the `parquet` extra '
            '(`pip install -e ".[parquet]"` in the simpletuner checkout, or `pip install pyarrow`)'
        ) from exc
    return pa, pq


def image_extension_of(data: bytes | None) -> str | None:
    """``.jpg`` / ``.png`` / ``.webp`` from the magic bytes of an encoded image, None when unknown."""
    if not data:
        return None
    if data.startswith(b"\xff\xd8\xff"):
        return ".jpg"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return ".png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ".webp"
    return None


def check_columns(
    schema, where: str, image_column: str, caption_column: str | None, filename_column: str | None
) -> None:
    """Refuse a Parquet file (its arrow ``schema``; ``where`` names it) without the named columns, or whose
    image column is not encoded images or caption column not text.

    Raises:
        ValueError: naming the file, the key and the columns the file has.
    """
    pa, _ = _pyarrow()
    named = {"image_column": image_column}
    if caption_column is not None:
        named["caption_column"] = caption_column
    if filename_column is not None:
        named["filename_column"] = filename_column
    absent = [f"{column!r} (`{key}`)" for key, column in named.items() if column not in schema.names]
    if absent:
        raise ValueError(
            f"{where} has no column {' or '.join(absent)}; its columns are: "
            f"{', '.join(map(repr, schema.names)) or 'none'}. Name one of those"
        )
    kind = schema.field(image_column).type
    is_bytes = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    is_image_struct = pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0
    if not (is_bytes or is_image_struct):
        raise ValueError(
            f"{where}: column {image_column!r} (`image_column`) is {kind}, not encoded images: "
            "expected binary, or the Hugging Face Image struct {bytes, path}; name the column of image bytes"
        )
    if caption_column is not None:
        text = schema.field(caption_column).type
        if pa.types.is_list(text) or pa.types.is_large_list(text):
            text = text.value_type
        if not (pa.types.is_string(text) or pa.types.is_large_string(text)):
            raise ValueError(
                f"{where}: column {caption_column!r} (`caption_column`) is {text}, not text; "
                "name the column of captions, or set `caption_column` to null"
            )


def check_file_columns(
    path: Path, where: str, image_column: str, caption_column: str | None, filename_column: str | None
) -> None:
    """:func:`check_columns` on the Parquet file ``path`` (its footer only).

    Raises:
        ValueError: the file is not readable Parquet, or as :func:`check_columns`.
    """
    pa, pq = _pyarrow()
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{where} is not a readable Parquet file ({exc})") from None
    check_columns(schema, where, image_column, caption_column, filename_column)


@dataclass
class _ParquetLayout:
    is_struct: bool  # the image column is the Hugging Face Image struct {bytes, path}
    row_starts: list[int]  # first row of each row group


class ParquetBackend(_ShardBackend):
    """Parquet files under ``root`` holding encoded images and captions, read in place.

    ``image_column``: plain binary or the Hugging Face ``datasets`` Image struct; rows are named by
    ``filename_column``, else the struct's ``path``, else the row number (DATA_SOURCES.md, "Parquet");
    ``caption_column`` (None: no captions) appears as ``<stem>.txt`` per row. A read loads its row's whole row
    group (image and caption columns only) and keeps the last ``row_group_cache_size``, so reading in
    ``list_files`` order reads each row group once.
    """

    suffix = ".parquet"
    kind = "Parquet"

    def __init__(
        self,
        root: str | Path,
        id: str,
        image_column: str = "image",
        caption_column: str | None = "text",
        filename_column: str | None = None,
        row_group_cache_size: int = ROW_GROUP_CACHE_SIZE,
        files: Sequence[str] | None = None,
    ):
        """``files``: the Parquet files to read, relative POSIX paths under ``root``; None: every ``.parquet``
        file under it."""
        self._pa, self._pq = _pyarrow()
        super().__init__(root, id, files)
        self.image_column = image_column
        self.caption_column = caption_column
        self.filename_column = filename_column
        self.row_group_cache_size = max(1, row_group_cache_size)
        self._layouts: list[_ParquetLayout] = []
        self._cache: OrderedDict[tuple[int, int], tuple[Any, Any]] = OrderedDict()
        self._lock = threading.Lock()
        for index in range(len(self.shards)):
            self._index_parquet(index)

    def __getstate__(self) -> dict:  # picklable (worker processes): no lock, modules or cached row groups
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_cache", "_pa", "_pq")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._pa, self._pq = _pyarrow()
        self._lock = threading.Lock()
        self._cache = OrderedDict()

    def _open(self, index: int):
        pa, pq = self._pa, self._pq
        try:
            return pq.ParquetFile(self.shards[index].full)
        except FileNotFoundError:
            raise self._gone(index) from None
        except (pa.ArrowException, OSError) as exc:  # ArrowInvalid: not a Parquet file (or cut off)
            raise ValueError(
                f"{self._where(index)} is not a readable Parquet file ({exc}); replace it or move it out of "
                "`instance_data_dir`"
            ) from None

    def _index_parquet(self, index: int) -> None:
        pa = self._pa
        with self._open(index) as parquet:
            schema = parquet.schema_arrow
            self._check_columns(index, schema)
            image_type = schema.field(self.image_column).type
            is_struct = pa.types.is_struct(image_type)
            metadata = parquet.metadata
            starts = [0]
            for group in range(metadata.num_row_groups):
                starts.append(starts[-1] + metadata.row_group(group).num_rows)
            num_rows = starts.pop()
            if self.filename_column is not None:
                names = parquet.read(columns=[self.filename_column]).column(0).to_pylist()
            elif is_struct and image_type.get_field_index("path") >= 0:
                column = parquet.read(columns=[f"{self.image_column}.path"]).column(0).combine_chunks()
                names = column.field("path").to_pylist()
            else:
                names = [None] * num_rows
        layout = _ParquetLayout(is_struct, starts)
        self._layouts.append(layout)
        width = max(6, len(str(max(num_rows - 1, 0))))
        cleaned = [_row_name(value) for value in names]
        sniffed = self._sniff(index, layout, [row for row, name in enumerate(cleaned) if not _has_image_suffix(name)])
        stems: set[str] = set()
        shard = self.shards[index]
        for row, name in enumerate(cleaned):
            number = f"{row:0{width}d}"
            if name is None:
                name = number + (sniffed.get(row) or ".jpg")
            elif not _has_image_suffix(name):
                name += sniffed.get(row) or ".jpg"
            while PurePosixPath(name).stem in stems:  # every image keeps its own caption file
                name = f"{number}-{name}"
            stems.add(PurePosixPath(name).stem)
            path = f"{shard.path}/{name}"
            self._add(path, _Entry(index, row, -1, False))
            if self.caption_column is not None:
                self._add(caption_file(path), _Entry(index, row, -1, True))

    def _check_columns(self, index: int, schema) -> None:
        check_columns(schema, self._where(index), self.image_column, self.caption_column, self.filename_column)

    def _sniff(self, index: int, layout: _ParquetLayout, rows: list[int]) -> dict[int, str | None]:
        """The image extension of each of ``rows`` from its bytes (rows with no usable name); reads only
        the row groups holding them, once each."""
        found: dict[int, str | None] = {}
        groups = sorted({bisect.bisect_right(layout.row_starts, row) - 1 for row in rows})
        for group in groups:
            images, _ = self._load_row_group(index, group, with_captions=False)
            first = layout.row_starts[group]
            for offset in range(len(images)):
                found[first + offset] = image_extension_of(_head(images[offset]))
        return found

    def _load_row_group(self, index: int, group: int, with_captions: bool = True) -> tuple[Any, Any]:
        """Row group ``group`` of shard ``index``: (image bytes array, caption array or None); the only
        place rows are read after indexing (tests count its calls)."""
        self._check_unchanged(index, self._stat(index))
        layout = self._layouts[index]
        image_spec = f"{self.image_column}.bytes" if layout.is_struct else self.image_column
        columns = [image_spec]
        if with_captions and self.caption_column is not None:
            columns.append(self.caption_column)
        with self._open(index) as parquet:
            table = parquet.read_row_group(group, columns=columns)
        images = table.column(self.image_column).combine_chunks()
        if layout.is_struct:
            images = images.field("bytes")
        captions = table.column(self.caption_column).combine_chunks() if len(columns) > 1 else None
        return images, captions

    def _row(self, entry: _Entry) -> tuple[Any, Any]:
        """The image bytes (None when null) and the caption cell of ``entry``'s row."""
        layout = self._layouts[entry.shard]
        group = bisect.bisect_right(layout.row_starts, entry.position) - 1
        key = (entry.shard, group)
        with self._lock:
            cached = self._cache.get(key)
            if cached is None:
                cached = self._load_row_group(entry.shard, group)
                self._cache[key] = cached
                while len(self._cache) > self.row_group_cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        images, captions = cached
        offset = entry.position - layout.row_starts[group]
        return images[offset].as_py(), (captions[offset].as_py() if captions is not None else None)

    def read(self, path: str) -> bytes:
        """The image bytes of the row behind ``path``, or its caption (UTF-8) for a ``.txt`` path.

        Raises:
            ValueError: the row's image is null (no bytes in the file), naming the file and row.
        """
        entry = self._entry(path)
        image, caption = self._row(entry)
        if entry.is_caption:
            return _caption_text(caption).encode("utf-8")
        if image is None:
            raise ValueError(
                f"{self.shards[entry.shard].full}, row {entry.position}: the column {self.image_column!r} has no "
                "image bytes (null). A Hugging Face dataset that only records image paths needs its images "
                "embedded in the file (`datasets` does so when it saves with `embed_external_files`)"
            )
        return image

    def read_head(self, path: str, num_bytes: int) -> bytes:
        """Up to ``num_bytes`` bytes from the start of ``path`` (the row group is read whole)."""
        return self.read(path)[:num_bytes]

    def size(self, path: str) -> int:
        """The length of the row's image bytes (0 when null) or caption."""
        entry = self._entry(path)
        image, caption = self._row(entry)
        if entry.is_caption:
            return len(_caption_text(caption).encode("utf-8"))
        return len(image) if image is not None else 0


def _head(value: Any) -> bytes | None:
    """The first bytes of one cell of an arrow binary array (without copying the whole value)."""
    if not value.is_valid:
        return None
    buffer = value.as_buffer()
    return buffer[:16].to_pybytes()


def _row_name(value: Any) -> str | None:
    """A row's file name from a name cell: its last path component, None when empty or hidden."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    name = str(value).strip().replace("\\", "/").rstrip("/").rpartition("/")[2]
    return name if name and not name.startswith(".") else None


def _has_image_suffix(name: str | None) -> bool:
    return name is not None and PurePosixPath(name).suffix.lower() in IMAGE_EXTENSIONS


def _caption_text(cell: Any) -> str:
    """A caption cell as text: a string, the first non-empty string of a list, "" when null."""
    if isinstance(cell, list):
        return next((c for c in cell if c and c.strip()), "")
    return cell or ""


def caption_column_read(dataset_cfg: ParquetDatasetConfig | HuggingFaceDatasetConfig) -> str | None:
    """The caption column a Parquet dataset entry reads: ``caption_column`` with ``caption_strategy: textfile``
    (then it must exist), else none."""
    return dataset_cfg.caption_column if dataset_cfg.caption_strategy == "textfile" else None


def build_parquet_backend(dataset_cfg: ParquetDatasetConfig, config: TrainingConfig) -> ParquetBackend:
    """A :class:`ParquetBackend` over the ``.parquet`` files under ``dataset_cfg.instance_data_dir``."""
    return ParquetBackend(
        dataset_cfg.instance_data_dir,
        dataset_cfg.id,
        image_column=dataset_cfg.image_column,
        caption_column=caption_column_read(dataset_cfg),
        filename_column=dataset_cfg.filename_column,
    )
