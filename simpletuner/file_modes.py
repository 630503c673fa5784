"""Output files get ordinary permissions: ``0666 & ~umask`` (0644 under the usual umask 022).

safetensors' ``save_file`` (0.8) writes through a private temporary file and keeps its mode,
0600, so every ``.safetensors`` we write (the final LoRA, checkpoint weights, cache shards), and
those diffusers writes for us (``save_lora_weights``, ``save_pretrained``), came out readable by
their owner only, unlike the ``.pt`` / ``.json`` files beside them. The writers call
:func:`ordinary_permissions` on what they wrote.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_lock = threading.Lock()


def current_umask() -> int:
    """The process umask (read by setting it and putting it back, under a lock)."""
    with _lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def ordinary_permissions(*paths: str | os.PathLike) -> None:
    """Give each file (every file under each folder) the mode ``0666 & ~umask``; missing paths are skipped."""
    mode = 0o666 & ~current_umask()
    for path in map(Path, paths):
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path] if path.is_file() else []
        for file in files:
            if (file.stat().st_mode & 0o777) != mode:
                os.chmod(file, mode)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync, rename: readers see the old or the new file whole
    (a failed write leaves no temporary file behind)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
