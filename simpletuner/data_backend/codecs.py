"""Byte codecs for staged datasets: lz4, zlib, snappy, or none.

A :class:`Codec` is a name and two stateless functions, so one object is safely shared by
every loader and reader thread. The optional libraries (``lz4``, ``python-snappy``) are
imported only when their codec is asked for.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

#: Codec names :func:`get_codec` accepts, in the order error messages list them.
CODEC_NAMES: tuple[str, ...] = ("lz4", "zlib", "snappy", "none")

#: zlib level: 1 is several times faster than the default 6 and loses only a few percent.
ZLIB_LEVEL = 1


@dataclass(frozen=True)
class Codec:
    """A named pair of stateless ``bytes -> bytes`` functions (thread-safe by construction)."""

    name: str
    compress: Callable[[bytes], bytes]
    decompress: Callable[[bytes], bytes]

    def __repr__(self) -> str:
        return f"Codec({self.name!r})"


def _identity(data: bytes) -> bytes:
    return data


def _zlib_compress(data: bytes) -> bytes:
    return zlib.compress(data, ZLIB_LEVEL)


def _lz4() -> Codec:
    try:
        import lz4.frame
    except ImportError:
        raise ImportError("compression 'lz4' needs the lz4 package: pip install lz4") from None

    def compress(data: bytes) -> bytes:
        # Fastest level; content checksums off: the bytes never leave this process.
        return lz4.frame.compress(data, compression_level=lz4.frame.COMPRESSIONLEVEL_MIN, content_checksum=False)

    return Codec("lz4", compress, lz4.frame.decompress)


def _snappy() -> Codec:
    try:
        import snappy
    except ImportError:
        raise ImportError("compression 'snappy' needs the python-snappy package: pip install python-snappy") from None
    return Codec("snappy", snappy.compress, snappy.decompress)


def get_codec(name: str) -> Codec:
    """The codec called ``name`` (``"lz4"``, ``"zlib"``, ``"snappy"`` or ``"none"``).

    Raises:
        ValueError: an unknown name; the message lists the known ones.
        ImportError: the codec's library is not installed; the message names the pip package.
    """
    if name == "none":
        return Codec("none", _identity, _identity)
    if name == "zlib":
        return Codec("zlib", _zlib_compress, zlib.decompress)
    if name == "lz4":
        return _lz4()
    if name == "snappy":
        return _snappy()
    raise ValueError(f"unknown compression {name!r}; known: {', '.join(CODEC_NAMES)}")
