"""Conditioning images generated from a dataset's own images at start (a dataset's ``conditioning`` block, e.g.
``{"type": "canny"}``): the ControlNet control images or an edit model's sources, without a folder of them.

Each image of the dataset gets its generated image in the dataset's generated folder (:func:`generated_folder`:
``<cache_dir>/conditioning_data/<id>_conditioning_<type>`` unless the block names one, as SimpleTuner's), at the
same relative path and name, encoded in the image's own format (a JPEG image's edge map is a JPEG, as SimpleTuner
writes it: helpers/data_generation/conditioning.py:88-104). The folder then pairs with the images exactly as a
``conditioning_data_dir`` does (:func:`~simpletuner.data_backend.pairs.find_sources`), so caching, the aspect
checks and validation see ordinary source files.

The folder belongs to the dataset: a manifest (:data:`MANIFEST`) records the settings and each image's identity
when its file was made; an image that changed, or new settings, are generated again, and files without an image
are removed. One process generates while the others wait on the folder's lock (``.generating.lock``), then find
everything in place. See documentation/MODEL_FAMILIES.md, "ControlNet" and "Flux Kontext".
"""

from __future__ import annotations

import io
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import orjson
from tqdm.auto import tqdm

from simpletuner.data_backend.canny import canny_image
from simpletuner.data_backend.images import load_rgb
from simpletuner.data_backend.pairs import list_images, listed
from simpletuner.file_modes import write_atomic
from simpletuner.locks import FolderLock

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.configuration.dataset_sections import FolderDatasetConfig
    from simpletuner.data_backend.base import DataBackend

logger = logging.getLogger(__name__)

MANIFEST = ".generated.json"
LOCK = ".generating.lock"
#: The format each image extension is written in (SimpleTuner's map, conditioning.py:92-100).
FORMATS = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".webp": "WEBP"}
#: Bumped when what a generator writes changes, so older folders are generated again.
VERSION = 1
#: At most this many images are generated at once (threads: decoding and the generator's torch ops release the GIL).
MAX_WORKERS = 8


def generated_folder(dataset_cfg: FolderDatasetConfig, config: TrainingConfig) -> Path:
    """Where ``dataset_cfg``'s generated conditioning images are kept."""
    generator = dataset_cfg.conditioning
    assert generator is not None, "only a dataset with a `conditioning` block has generated images"
    if generator.instance_data_dir is not None:
        return Path(generator.instance_data_dir).expanduser()
    root = Path(config.cache_config.cache_dir).expanduser()
    return root / "conditioning_data" / f"{dataset_cfg.id}_conditioning_{generator.type}"


def _settings(dataset_cfg: FolderDatasetConfig) -> dict[str, Any]:
    generator = dataset_cfg.conditioning
    assert generator is not None
    return {
        "type": generator.type,
        "low_threshold": generator.low_threshold,
        "high_threshold": generator.high_threshold,
        "version": VERSION,
    }


def _relative(path: str) -> PurePosixPath:
    """``path`` as a relative path inside the folder (a listing's paths are; anything else is refused)."""
    relative = PurePosixPath(path)
    if relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"cannot generate a conditioning image for {path!r}: not a path inside the dataset")
    return relative


def _generate_one(backend: DataBackend, dataset_cfg: FolderDatasetConfig, folder: Path, path: str) -> None:
    """Generate ``path``'s conditioning image into ``folder`` (written whole or not at all)."""
    generator = dataset_cfg.conditioning
    assert generator is not None
    image = load_rgb(backend.read(path))
    made = canny_image(image, generator.low_threshold, generator.high_threshold)
    relative = _relative(path)
    buffer = io.BytesIO()
    made.save(buffer, format=FORMATS.get(relative.suffix.lower(), "PNG"))
    target = folder / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, buffer.getvalue())


def _read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = orjson.loads((folder / MANIFEST).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def generate_conditioning(
    backend: DataBackend, dataset_cfg: FolderDatasetConfig, config: TrainingConfig, paths: list[str]
) -> tuple[Path, dict[str, str]]:
    """Make sure each image of ``paths`` (the dataset's listing) has its generated conditioning image, up to date
    (module docstring). Returns the folder and ``{path: reason}`` for the images that could not be read or decoded
    (they are the scan's bad files; the others are generated).

    Raises:
        ValueError: the folder or its lock cannot be created.
    """
    folder = generated_folder(dataset_cfg, config)
    settings = _settings(dataset_cfg)
    lock = FolderLock(folder / LOCK)
    lock.acquire_waiting(
        lambda: logger.info("dataset %r: another process is generating its conditioning images; waiting", backend.id)
    )
    try:
        manifest = _read_manifest(folder)
        previous: dict[str, str] = manifest.get("files", {})
        made = dict(previous) if manifest.get("settings") == settings else {}
        present = list_images(folder)
        foreign = [name for name in present if name not in previous]
        if foreign:
            raise ValueError(
                f"dataset {backend.id!r}: the folder for its generated conditioning images, {folder}, holds images "
                f"this trainer did not generate ({listed(foreign)}); they are never overwritten or removed. Point "
                "`conditioning.instance_data_dir` at a folder of its own, or move them out"
            )
        wanted = {path: backend.identity(path) for path in paths}
        for name in present:  # made for images that are gone or changed, or under other settings
            if name not in wanted or made.get(name) != wanted[name]:
                (folder / name).unlink()
                made.pop(name, None)
        todo = [path for path in paths if made.get(path) != wanted[path] or not (folder / path).is_file()]
        failed: dict[str, str] = {}
        if todo:
            _generate(backend, dataset_cfg, folder, todo, made, wanted, failed)
            write_atomic(folder / MANIFEST, orjson.dumps({"settings": settings, "files": made}))
        return folder, failed
    finally:
        lock.release()


def _generate(
    backend: DataBackend,
    dataset_cfg: FolderDatasetConfig,
    folder: Path,
    todo: list[str],
    made: dict[str, str],
    wanted: dict[str, str],
    failed: dict[str, str],
) -> None:
    """Generate ``todo`` in threads with a progress bar, recording each success in ``made``, each failure in
    ``failed``."""
    generator = dataset_cfg.conditioning
    assert generator is not None

    def one(path: str) -> tuple[str, str | None]:
        try:
            _generate_one(backend, dataset_cfg, folder, path)
        except (OSError, ValueError) as exc:  # unreadable or undecodable: a bad file of the scan
            return path, f"cannot generate its {generator.type} conditioning image: {exc}"
        return path, None

    workers = max(1, min(MAX_WORKERS, os.cpu_count() or 1, len(todo)))
    desc = f"generating {generator.type} conditioning for {backend.id}"
    with ThreadPoolExecutor(workers) as pool:
        for path, problem in tqdm(pool.map(one, todo), total=len(todo), desc=desc, unit="img", disable=None):
            if problem is None:
                made[path] = wanted[path]
            else:
                failed[path] = problem
    logger.info(
        "dataset %r: generated %d %s conditioning image(s) in %s%s",
        backend.id,
        len(todo) - len(failed),
        generator.type,
        folder,
        f" ({len(failed)} could not be read)" if failed else "",
    )
