"""The storage protocol every dataset backend implements.

A backend answers questions about files by their path *relative to the dataset root*
(POSIX separators): which files exist, their bytes, their size, and a cheap identity
string that changes whenever the content changes. It knows nothing about images,
captions or buckets; that lives in ``metadata``.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Protocol, runtime_checkable

#: File extensions (lowercase, with the dot) treated as training images.
IMAGE_EXTENSIONS: frozenset[str] = frozenset({".jpg", ".jpeg", ".png", ".webp"})
#: Video files of a video dataset, decoded with PyAV (the optional ``video`` extra).
VIDEO_FILE_EXTENSIONS: frozenset[str] = frozenset({".mp4", ".webm", ".mov", ".mkv"})
#: Animated images a video dataset reads as clips with Pillow (``.webp`` only when animated).
ANIMATED_IMAGE_EXTENSIONS: frozenset[str] = frozenset({".gif", ".webp"})
#: Files that are already compressed media: a staging backend keeps their bytes as they are.
ENCODED_MEDIA_EXTENSIONS: frozenset[str] = IMAGE_EXTENSIONS | VIDEO_FILE_EXTENSIONS | ANIMATED_IMAGE_EXTENSIONS


@runtime_checkable
class DataBackend(Protocol):
    """Read-only access to the files of one dataset.

    Paths are relative POSIX paths under the backend's root, as returned by
    :meth:`list_files`. Implementations: ``LocalDataBackend`` (disk); others register a
    builder in ``simpletuner.data_backend.factory.BUILDERS``.
    """

    id: str

    def list_files(self, extensions: Iterable[str] | None = None) -> list[str]:
        """Relative paths of every file under the root, recursive and sorted.

        ``extensions`` (lowercase, with the dot, e.g. ``{".png"}``) keeps only files whose
        lowercased suffix is in it; ``None`` keeps every file. Hidden files and folders
        (names starting with ``.``) are skipped.
        """
        ...

    def read(self, path: str) -> bytes:
        """The full content of ``path``; FileNotFoundError naming it if it is missing."""
        ...

    def exists(self, path: str) -> bool:
        """Whether ``path`` names an existing file."""
        ...

    def size(self, path: str) -> int:
        """Size of ``path`` in bytes."""
        ...

    def identity(self, path: str) -> str:
        """A cheap string that changes when the content of ``path`` changes (a cache-key part)."""
        ...


def normalize_extensions(extensions: Iterable[str] | None) -> frozenset[str] | None:
    """Lowercase the extensions and add a leading dot where missing (``"PNG"`` -> ``".png"``)."""
    if extensions is None:
        return None
    if isinstance(extensions, str):
        extensions = [extensions]
    return frozenset(e.lower() if e.startswith(".") else f".{e.lower()}" for e in extensions)


@runtime_checkable
class SupportsReadHead(Protocol):
    """Optional extra of a backend: read the first bytes of a file without reading it all.

    The metadata scan uses it to parse image headers of large files cheaply.
    """

    def read_head(self, path: str, num_bytes: int) -> bytes:
        """Up to ``num_bytes`` bytes from the start of ``path``."""
        ...


@runtime_checkable
class SupportsReadTail(Protocol):
    """Optional extra of a backend: read the last bytes of a file without reading it all.

    The metadata scan uses it to tell a cut-off JPEG or PNG from its end, without decoding it
    (:func:`~simpletuner.data_backend.image_headers.looks_cut_off`); without it, a file larger than the
    header read is checked only when the cache fill decodes it.
    """

    def read_tail(self, path: str, num_bytes: int) -> bytes:
        """Up to ``num_bytes`` bytes from the end of ``path``."""
        ...


@runtime_checkable
class SupportsStagingReport(Protocol):
    """Optional extra of a backend that reads every file up front (``GH200InMemoryBackend``):
    the files it found but could not read.

    Such a backend leaves them out of ``list_files``; the metadata scan counts them as bad files,
    so a dataset reports the same skipped paths and applies the same ``max_bad_image_fraction``
    whatever its ``type``.
    """

    def failed_files(self) -> Mapping[str, str]:
        """``{path: reason}`` of every file found but not read."""
        ...


@runtime_checkable
class SupportsShards(Protocol):
    """Optional extra of a backend whose files live inside larger shard files (tar, parquet): which
    shard holds a file. Readers that go through many files (the cache fill) keep one shard's files
    together, in ``list_files`` order, and give each process of a launch whole shards."""

    def shard_of(self, path: str) -> str:
        """The shard holding ``path`` (its relative path under the dataset root)."""
        ...
