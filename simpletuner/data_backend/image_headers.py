"""A fast path for image sizes: PNG and JPEG headers parsed without opening the file with Pillow.

:func:`fast_image_size` answers only when ``PIL.Image.open`` would open the same bytes without an error or
warning and report the same size and EXIF block; otherwise (WebP always, other formats, unusual headers)
it returns None and the caller asks Pillow, so sizes and error messages stay exactly Pillow's.
:func:`looks_cut_off` tells from a file's first and last bytes whether it may have been cut off.
See documentation/PERFORMANCE.md, "Issue 17: the metadata scan".
"""

from __future__ import annotations

import re
import struct
import zlib

from PIL import Image, ImageFile, PngImagePlugin
from PIL.JpegImagePlugin import MARKER

#: EXIF ``Orientation`` tag.
EXIF_ORIENTATION_TAG = 0x0112
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_PNG_MODES = frozenset(PngImagePlugin._MODES)
#: PNG chunks with a Pillow handler this parser does not reproduce: Pillow decides.
_PNG_PILLOW_ONLY = frozenset({b"IEND", b"iCCP", b"zTXt", b"iTXt", b"acTL", b"fcTL", b"fdAT"})
#: PNG chunks whose Pillow handler refuses data shorter than this (the rest only check the CRC).
_PNG_MIN_LENGTH = {b"gAMA": 4, b"cHRM": 32, b"sRGB": 1, b"pHYs": 9}
_IS_CID = re.compile(rb"\w\w\w\w").match
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
#: What Pillow's JPEG reader does at each marker (its ``MARKER`` table): "" (nothing), or the name
#: of the segment handler it calls (``Skip``, ``SOF``, ``DQT``, ``APP``, ``COM``).
_JPEG_MARKERS = {code: (entry[2].__name__ if entry[2] is not None else "") for code, entry in MARKER.items()}
_SOS = 0xFFDA
#: Bytes read from the end of a file to tell whether it was cut off (:func:`looks_cut_off`).
TAIL_BYTES = 16
_JPEG_END = b"\xff\xd9"  # EOI
_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the IEND chunk: length 0, type, CRC


class _PillowDecides(Exception):
    """The fast path cannot vouch for these bytes."""


def exif_orientation_of(raw: bytes | None) -> int:
    """The ``Orientation`` of an EXIF block as Pillow reads it (``Image.Exif``), or 1 (none, or a
    block Pillow cannot read). A block without the tag's two bytes has no such tag: 1 without
    parsing."""
    if not raw or (b"\x01\x12" not in raw and b"\x12\x01" not in raw):
        return 1
    exif = Image.Exif()
    try:
        exif.load(raw)
    except (OSError, SyntaxError, EOFError, struct.error, ValueError, IndexError, Image.DecompressionBombError):
        return 1  # a broken EXIF block does not make the image unusable
    value = exif.get(EXIF_ORIENTATION_TAG, 1)
    return value if isinstance(value, int) else 1


def fast_image_size(data: bytes) -> tuple[int, int, int] | None:
    """``(width, height, orientation)`` of a PNG or JPEG: the size ``PIL.Image.open`` reports (before
    EXIF orientation) and the orientation of its ``info["exif"]`` (:func:`exif_orientation_of`), or
    None: ask Pillow."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        return None
    try:
        if data.startswith(_PNG_MAGIC):
            width, height, orientation = _png(data)
        elif data.startswith(b"\xff\xd8\xff"):
            width, height, orientation = _jpeg(data)
        else:
            return None
    except (_PillowDecides, struct.error, IndexError):
        return None
    limit = Image.MAX_IMAGE_PIXELS
    if width <= 0 or height <= 0 or (limit is not None and width * height > limit):
        return None  # Pillow refuses it or warns (a possible decompression bomb)
    return width, height, orientation


def looks_cut_off(head: bytes, tail: bytes, size: int | None = None) -> bool:
    """Whether the file whose first bytes are ``head`` and last bytes ``tail`` (``size`` bytes in all; None:
    not known) may be cut off: a JPEG that does not end with its end-of-image marker, a PNG that does not end
    with its IEND chunk, a WebP shorter than its RIFF header says. It is only a reason to decode the file:
    a file with data after its end (a phone's motion photo carries a video after the JPEG) decodes, and a PNG
    whose IEND alone is missing decodes too. Other formats: False (not checked)."""
    if head.startswith(b"\xff\xd8\xff"):
        return not tail.endswith(_JPEG_END)
    if head.startswith(_PNG_MAGIC):
        return not tail.endswith(_PNG_END)
    if size is not None and len(head) >= 12 and head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return size < struct.unpack_from("<I", head, 4)[0] + 8
    return False


def _png(data: bytes) -> tuple[int, int, int]:  # noqa: C901, PLR0915
    """Pillow's ``PngImageFile._open``: chunks up to the first IDAT, each CRC checked."""
    size = mode = exif = None
    text_memory = 0
    pos, end = 8, len(data)
    while True:
        if pos + 8 > end:
            raise _PillowDecides
        (length,) = _U32.unpack_from(data, pos)
        cid = data[pos + 4 : pos + 8]
        if not _IS_CID(cid) or cid in _PNG_PILLOW_ONLY:
            raise _PillowDecides
        if cid == b"IDAT":
            break
        start, stop = pos + 8, pos + 8 + length
        if stop + 4 > end:
            raise _PillowDecides
        body = data[start:stop]
        if zlib.crc32(body, zlib.crc32(cid)) != _U32.unpack_from(data, stop)[0]:
            raise _PillowDecides
        if cid == b"IHDR":
            if length < 13 or body[11] or (body[8], body[9]) not in _PNG_MODES:
                raise _PillowDecides
            size, mode = _U32.unpack_from(body, 0) + _U32.unpack_from(body, 4), (body[8], body[9])
        elif cid == b"tRNS":
            if mode is not None and mode[1] in (0, 2) and length < (6 if mode[1] == 2 else 2):
                raise _PillowDecides
        elif cid == b"tEXt":
            key, _, value = body.partition(b"\0")
            if key:
                text_memory += len(value)
                if text_memory > PngImagePlugin.MAX_TEXT_MEMORY:
                    raise _PillowDecides
                if key == b"exif":
                    exif = value
        elif cid == b"eXIf":
            exif = b"Exif\x00\x00" + body
        elif length < _PNG_MIN_LENGTH.get(cid, 0):
            raise _PillowDecides
        pos = stop + 4
    if size is None:
        raise _PillowDecides
    return size[0], size[1], _orientation(exif)


def _jpeg(data: bytes) -> tuple[int, int, int]:  # noqa: C901, PLR0915
    """Pillow's ``JpegImageFile._open`` up to the first SOS, for files without MPO or Photoshop
    segments; an EXIF block is read the way Pillow's ``_read_dpi_from_exif`` reads it."""
    size = exif = None
    has_dpi = False
    icc: list[bytes] = []
    pos, end = 3, len(data)
    byte = 0xFF  # Pillow's one-byte look-ahead; -1 at the end of the data
    while byte >= 0:
        if byte != 0xFF:  # junk between segments
            byte = data[pos] if pos < end else -1
            pos += 1
            continue
        if pos >= end:
            break
        marker = 0xFF00 | data[pos]
        pos += 1
        kind = _JPEG_MARKERS.get(marker)
        if kind is None:
            if marker == 0xFFFF:
                continue  # padding: the look-ahead stays 0xFF
            if marker != 0xFF00:
                raise _PillowDecides  # "no marker found"
        elif kind:
            if pos + 2 > end:
                raise _PillowDecides
            n = _U16.unpack_from(data, pos)[0] - 2
            pos += 2
            segment = b""
            if n > 0:
                if pos + n > end:
                    raise _PillowDecides
                segment = data[pos : pos + n]
                pos += n
            if kind == "DQT":
                _check_dqt(segment)
            elif kind == "SOF":
                size, icc = _check_sof(segment, icc), []
            elif kind == "APP":
                if marker == 0xFFE0 and segment.startswith(b"JFIF"):
                    if len(segment) < 7:
                        raise _PillowDecides
                    has_dpi = has_dpi or (len(segment) >= 12 and segment[7] in (1, 2))
                elif marker == 0xFFE1 and segment.startswith(b"Exif\0\0"):
                    exif = segment if exif is None else exif + segment[6:]
                elif marker == 0xFFE2 and segment.startswith(b"ICC_PROFILE\0"):
                    icc.append(segment)
                elif marker == 0xFFE2 and segment.startswith(b"MPF\0"):
                    raise _PillowDecides  # maybe an MPO
                elif marker == 0xFFED and segment.startswith(b"Photoshop 3.0\x00"):
                    raise _PillowDecides
                elif marker == 0xFFEE and segment.startswith(b"Adobe") and len(segment) < 7:
                    raise _PillowDecides
            elif kind not in ("Skip", "COM"):
                raise _PillowDecides  # a handler this parser does not know (another Pillow version)
            if marker == _SOS:
                break
        byte = data[pos] if pos < end else -1
        pos += 1
    if size is None:
        raise _PillowDecides
    if exif is None or has_dpi:
        return size[0], size[1], _orientation(exif)
    return size[0], size[1], _orientation_and_dpi_check(exif)


def _orientation(exif: bytes | None) -> int:
    try:
        return exif_orientation_of(exif)
    except Exception:  # noqa: BLE001 - whatever Pillow's EXIF code raises, its own path must decide and word it
        raise _PillowDecides from None  # Pillow's path raises here too: let it say what


def _check_dqt(segment: bytes) -> None:
    while segment:
        qt_length = 1 + (1 if segment[0] // 16 == 0 else 2) * 64
        if len(segment) < qt_length:
            raise _PillowDecides
        segment = segment[qt_length:]


def _check_sof(segment: bytes, icc: list[bytes]) -> tuple[int, int]:
    if len(segment) < 6 or segment[0] != 8 or segment[5] not in (1, 3, 4) or (len(segment) - 6) % 3:
        raise _PillowDecides  # Pillow refuses the depth or layer count, or indexes past a cut-off component
    if icc and len(min(icc)) < 14:
        raise _PillowDecides  # Pillow indexes byte 13 of the first fragment
    return _U16.unpack_from(segment, 3)[0], _U16.unpack_from(segment, 1)[0]


def _orientation_and_dpi_check(exif: bytes) -> int:
    """:func:`exif_orientation_of` ``exif``, checking on the way what Pillow checks: it reads a JPEG's
    DPI from its EXIF block when no JFIF segment gives one, so the block must load and its resolution
    tags convert without an error Pillow lets through (the orientation is read from the same
    loaded block, as a fresh load of the same bytes would give it)."""
    reader = Image.Exif()
    try:
        reader.load(exif)
    except Exception:  # noqa: BLE001 - whatever Pillow's EXIF code raises, its own path must decide and word it
        raise _PillowDecides from None
    try:
        unit, x_resolution = reader[0x0128], reader[0x011A]
        try:
            dpi = float(x_resolution[0]) / x_resolution[1]
        except TypeError:
            dpi = x_resolution
        float(dpi) * (2.54 if unit == 3 else 1)
    except (struct.error, KeyError, SyntaxError, TypeError, ValueError, ZeroDivisionError):
        pass  # Pillow falls back to 72 dpi
    except Exception:  # noqa: BLE001 - whatever Pillow's EXIF code raises, its own path must decide and word it
        raise _PillowDecides from None
    try:
        value = reader.get(EXIF_ORIENTATION_TAG, 1)
    except Exception:  # noqa: BLE001 - whatever Pillow's EXIF code raises, its own path must decide and word it
        raise _PillowDecides from None  # Pillow's path raises here too: let it say what
    return value if isinstance(value, int) else 1
