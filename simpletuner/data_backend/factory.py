"""Build the run's datasets from the config: each a storage backend and its scanned metadata."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from simpletuner.configuration.cache_paths import is_trained, left_out_reason
from simpletuner.configuration.dataset_sections import url_protocol
from simpletuner.data_backend.base import DataBackend, SupportsStagingReport
from simpletuner.data_backend.buckets import bucket_name
from simpletuner.data_backend.images import load_rgb, prepare_image
from simpletuner.data_backend.local import LocalDataBackend
from simpletuner.data_backend.metadata import DatasetMetadata, Sample, build_metadata
from simpletuner.data_backend.pairs import check_model_inputs, source_pixels
from simpletuner.data_backend.video import load_clip_pixels

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)


@dataclass
class RegisteredDataset:
    """One dataset of the run: its config entry, storage backend and scanned metadata."""

    id: str
    config: Any  # the dataset's entry in ``TrainingConfig.datasets`` (e.g. LocalDatasetConfig)
    backend: DataBackend
    metadata: DatasetMetadata

    @property
    def samples(self) -> list[Sample]:
        """Every sample of this dataset (each image ``1 + repeats`` times)."""
        return self.metadata.samples


def build_local_backend(dataset_cfg: Any, config: "TrainingConfig") -> DataBackend:
    """A ``LocalDataBackend`` over ``dataset_cfg.instance_data_dir``."""
    return LocalDataBackend(dataset_cfg.instance_data_dir, dataset_cfg.id)


def build_in_memory_backend(dataset_cfg: Any, config: "TrainingConfig") -> DataBackend:
    """A ``GH200InMemoryBackend`` staging ``dataset_cfg.instance_data_dir`` in RAM.

    Imported on use: ``simpletuner.data_backend.in_memory`` imports this package, so a
    module-level import here would be circular whenever that module is imported first.
    """
    from simpletuner.data_backend.in_memory import build_in_memory_backend as build

    return build(dataset_cfg, config)


def build_object_store_backend(dataset_cfg: Any, config: "TrainingConfig") -> DataBackend:
    """An ``ObjectStoreBackend`` over the fsspec URL ``dataset_cfg.instance_data_dir`` (imported on use:
    fsspec and its protocol packages are optional)."""
    from simpletuner.data_backend.object_store import build_object_store_backend as build

    return build(dataset_cfg, config)


def build_webdataset_backend(dataset_cfg: Any, config: "TrainingConfig") -> DataBackend:
    """A ``WebDatasetBackend`` over the tar shards of ``dataset_cfg``."""
    from simpletuner.data_backend.shards import build_webdataset_backend as build

    return build(dataset_cfg, config)


def build_parquet_backend(dataset_cfg: Any, config: "TrainingConfig") -> DataBackend:
    """A ``ParquetBackend`` over the parquet files of ``dataset_cfg`` (pyarrow: the ``parquet`` extra)."""
    from simpletuner.data_backend.parquet_shards import build_parquet_backend as build

    return build(dataset_cfg, config)


def build_huggingface_backend(dataset_cfg: Any, config: "TrainingConfig") -> DataBackend:
    """A ``ParquetBackend`` over the Parquet files of a Hub dataset's split, fetched into the Hub cache (imported
    on use: huggingface_hub and pyarrow load only for such a dataset)."""
    from simpletuner.data_backend.hub_dataset import build_huggingface_backend as build

    return build(dataset_cfg, config)


#: Storage backend builders by the dataset entry's ``type``. A new backend is one line here, plus
#: its config class as a member of the ``DatasetConfig`` union (``simpletuner.configuration.schema``;
#: config error paths derive the tags from it) and its section in ``configuration/templates/CONFIG.md``.
BUILDERS: dict[str, Callable[[Any, "TrainingConfig"], DataBackend]] = {
    "local": build_local_backend,
    "in_memory": build_in_memory_backend,
    "object_store": build_object_store_backend,
    "webdataset": build_webdataset_backend,
    "parquet": build_parquet_backend,
    "huggingface": build_huggingface_backend,
}


def builder_for(dataset_cfg: Any) -> Callable[[Any, "TrainingConfig"], DataBackend]:
    """The builder for ``dataset_cfg.type``.

    Raises:
        ValueError: the type has no builder; the message names the dataset and the known types.
    """
    kind = dataset_cfg.type
    try:
        return BUILDERS[kind]
    except KeyError:
        raise ValueError(
            f"dataset {dataset_cfg.id!r}: unknown type {kind!r}; known types: {', '.join(sorted(BUILDERS))}. "
            "Set `type` to one of them"
        ) from None


def build_datasets(config: "TrainingConfig", spec: Any = None) -> list[RegisteredDataset]:
    """Build and scan every dataset of ``config``; returns them in config order (the caller records
    them: ``StateTracker.register_dataset``).

    Entries with ``disabled: true`` or ``probability: 0`` are left out (logged once each). With the run's
    model ``spec``, the data is first checked to fit what the model takes (edit pairs, ``validation_image``:
    :func:`~simpletuner.data_backend.pairs.check_model_inputs`), before anything is scanned.

    Raises:
        ValueError: no dataset entries, every one left out, an unknown type, data that does not fit ``spec``'s
            model, or a dataset the scan rejects (empty folder, too many unreadable images, unpaired edit images).
    """
    if not config.datasets:
        raise ValueError(
            "the config has no `datasets`: add dataset entries, or load the config with "
            "load_config() so that `data_backend_config` is read"
        )
    if spec is not None:
        check_model_inputs(spec, config)
    built = []
    for dataset_cfg in config.datasets:
        if not is_trained(dataset_cfg):  # never scanned or cached; the config rules refuse "all left out"
            logger.info("dataset %r left out of this run (%s)", dataset_cfg.id, left_out_reason(dataset_cfg))
            continue
        backend = builder_for(dataset_cfg)(dataset_cfg, config)
        metadata = build_metadata(backend, dataset_cfg, config, seed=config.seed, unreadable=staging_failures(backend))
        dataset = RegisteredDataset(id=dataset_cfg.id, config=dataset_cfg, backend=backend, metadata=metadata)
        built.append(dataset)
        _log_summary(dataset)
    if not built:
        raise ValueError(
            "every dataset is left out (`disabled: true` or `probability: 0`): enable at least one dataset"
        )
    return built


def build_source_backend(dataset_cfg: Any, config: "TrainingConfig") -> DataBackend:
    """The backend that reads ``dataset_cfg``'s files where they are, staging nothing: an ``in_memory`` entry's
    folder (or object store URL) read in place, every other type through its builder. Its file identities are
    those training keys the caches by, so ``simpletuner cache`` scans and hashes sources through it."""
    if dataset_cfg.type != "in_memory":
        return builder_for(dataset_cfg)(dataset_cfg, config)
    if url_protocol(dataset_cfg.instance_data_dir) is not None:
        from simpletuner.data_backend.object_store import backend_from_options

        return backend_from_options(dataset_cfg.instance_data_dir, dataset_cfg.id, dataset_cfg)
    return build_local_backend(dataset_cfg, config)


def staging_failures(backend: DataBackend) -> dict[str, str]:
    """Files a backend that reads everything up front found but could not read: ``{path: reason}``
    (:class:`~simpletuner.data_backend.base.SupportsStagingReport`). Backends that read on demand
    have none."""
    if isinstance(backend, SupportsStagingReport):
        return dict(backend.failed_files())
    return {}


def _log_summary(dataset: RegisteredDataset) -> None:
    meta = dataset.metadata
    buckets = Counter(bucket_name(s.bucket) for s in meta.samples)
    logger.info(
        "dataset %r: %d samples (%d skipped files), buckets %s, captions %s",
        dataset.id,
        len(meta.samples),
        len(meta.bad_files),
        dict(sorted(buckets.items())),
        meta.caption_sources,
    )


def load_sample_pixels(dataset: RegisteredDataset, sample: Sample) -> tuple[torch.Tensor, dict]:
    """Decode, resize and crop ``sample`` from ``dataset``: ``([3, H, W] in [-1, 1], crop info)``
    for an image, ``([3, num_frames, H, W], crop info)`` for a clip (every frame cropped alike), and
    ``([6, H, W], crop info)`` for an edit pair: the image, then its source with the same geometry
    (:func:`~simpletuner.data_backend.pairs.source_pixels`).

    Raises:
        ValueError: the file (a frame) cannot be decoded; OSError: it cannot be read.
    """
    if sample.is_video:
        return load_clip_pixels(dataset.backend, sample)
    image = load_rgb(dataset.backend.read(sample.path))
    pixels, info = prepare_image(image, sample.bucket, sample.crop_style, sample.crop_seed, sample.canvas)
    if sample.source is not None:
        pixels = torch.cat([pixels, source_pixels(sample)], dim=0)
    return pixels, info
