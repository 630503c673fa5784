"""Checkpoint integrity: the ``COMPLETE`` manifest a save writes last, and the checks a resume
runs before it reads anything.

The manifest lists every other file of the checkpoint folder with its size and sha256, plus a
sha256 of the manifest itself (see :mod:`simpletuner.training.checkpoint` for the layout).
:func:`verify_checkpoint` checks sizes first (a missing or truncated file is found without
hashing the rest), then hashes.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

logger = logging.getLogger(__name__)

MANIFEST_VERSION = 1
MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
#: Files every checkpoint has (the RNG file of each rank is checked when that rank loads).
REQUIRED_FILES = ("trainable.safetensors", "optimizer.pt", "lr_scheduler.pt", STATE_FILE)
_ATOMIC_TEMP = re.compile(r"^\.(latest|COMPLETE)\.tmp(-\d+)?$")


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


# --- errors -------------------------------------------------------------------------------
class ResumeRefused(ValueError):
    """A checkpoint that does not fit this run. Every rank finds the same: rank 0 alone prints it."""


class CheckpointDamaged(ResumeRefused):
    """The checkpoint to resume from (or every one in output_dir) fails its checks; the message
    names the file, what is wrong with it, and the fix."""


@dataclass(frozen=True)
class Damage:
    """Why a checkpoint folder cannot be resumed from: which file, and what is wrong with it."""

    checkpoint: Path
    file: str  # a name inside the checkpoint ("" for the folder itself)
    reason: str

    def __str__(self) -> str:
        where = self.checkpoint / self.file if self.file else self.checkpoint
        return f"{where} {self.reason}"


def _plain_reason(exc: BaseException) -> str:
    """The first line of a reader's error, without torch's advice to unpickle with weights_only=False."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [line for line in lines if "weights_only" not in line and "trusted source" not in line]
    first = lines[0] if lines else ""
    if "weights_only" in first or not first:
        return type(exc).__name__
    return first[:300]


# --- the manifest -------------------------------------------------------------------------
def _manifest_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _checkpoint_files(folder: Path) -> list[str]:
    """Every file under ``folder`` but the manifest (and its temp file), as sorted relative paths."""
    names = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel != MARKER and not _ATOMIC_TEMP.match(rel):
            names.append(rel)
    return sorted(names)


def build_manifest(folder: Path, step: int) -> bytes:
    """The COMPLETE manifest of ``folder``: every file with its size and sha256."""
    files = {
        name: {"size": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
        for name in _checkpoint_files(folder)
    }
    body = {"manifest_version": MANIFEST_VERSION, "step": step, "files": files}
    return orjson.dumps(dict(body, sha256=_manifest_digest(body)), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)


def _parse_manifest(raw: bytes) -> dict[str, dict[str, Any]]:
    """The manifest's file table; ValueError saying what is wrong with it."""
    try:
        manifest = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("manifest_version") != MANIFEST_VERSION:
        raise ValueError(f"not a version-{MANIFEST_VERSION} manifest")
    body = {k: manifest.get(k) for k in ("manifest_version", "step", "files")}
    if manifest.get("sha256") != _manifest_digest(body):
        raise ValueError("its own checksum does not match (the file was changed after it was written)")
    files = body["files"]
    if not isinstance(files, dict):
        raise ValueError("no file table")
    for name, entry in files.items():
        parts = Path(name).parts
        if (
            Path(name).is_absolute()
            or ".." in parts
            or not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get("sha256"), str)
        ):
            raise ValueError(f"a malformed entry {name!r}")
    return files


def _check_manifest(path: Path, raw: bytes) -> Damage | None:
    try:
        files = _parse_manifest(raw)
    except ValueError as exc:
        return Damage(path, MARKER, f"is not a readable manifest: {exc}")
    for name in REQUIRED_FILES:
        if name not in files:
            return Damage(path, MARKER, f"does not list {name}: the save that wrote it was incomplete")
    for name, entry in files.items():  # sizes first: cheap, and finds truncated and missing files
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            return Damage(path, name, "is missing (the manifest lists it)")
        except OSError as exc:
            return Damage(path, name, f"cannot be read ({exc.strerror})")
        if size != entry["size"]:
            return Damage(path, name, f"has {size} bytes, the manifest says {entry['size']} (truncated or overwritten)")
    for name, entry in files.items():
        try:
            digest = _sha256(path / name)
        except OSError as exc:
            return Damage(path, name, f"cannot be read ({exc.strerror})")
        if digest != entry["sha256"]:
            return Damage(
                path,
                name,
                "does not match its sha256 in the manifest (its bytes changed after the save: "
                "a disk or copy error, or an edit)",
            )
    return None


#: verify_checkpoint's answers, per folder, valid while no file in it changes (a resume asks
#: several times: the output_dir check, the finished-run check, the load).
_verified: dict[Path, tuple[tuple, Damage | None]] = {}
_said: set[str] = set()


def _warn_once(message: str, *args) -> None:
    text = message % args if args else message
    if text not in _said:
        _said.add(text)
        logger.warning("%s", text)


def _folder_signature(path: Path) -> tuple:
    entries = []
    for file in sorted(path.rglob("*")):
        try:
            st = file.stat()
        except OSError:
            continue
        entries.append((file.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(entries)


def verify_checkpoint(path: Path) -> Damage | None:
    """None when ``path`` is a checkpoint that can be resumed from as it is, else what is wrong:
    the first file that is missing, of another size, or of another sha256 than its manifest says."""
    path = Path(path)
    if not path.is_dir():
        return Damage(path, "", "does not exist or is not a folder")
    signature = _folder_signature(path)
    key = path.resolve()
    cached = _verified.get(key)
    if cached is not None and cached[0] == signature:
        return cached[1]
    damage: Damage | None
    try:
        raw = (path / MARKER).read_bytes()
    except FileNotFoundError:
        damage = Damage(path, MARKER, "is missing: the save was interrupted, or the file was deleted")
    except OSError as exc:
        damage = Damage(path, MARKER, f"cannot be read ({exc.strerror})")
    else:
        damage = _check_manifest(path, raw)
    _verified[key] = (signature, damage)
    return damage
