"""Datasets: storage backends, image and video-clip metadata and aspect buckets, and the bucket sampler."""

from simpletuner.data_backend.base import IMAGE_EXTENSIONS, VIDEO_FILE_EXTENSIONS, DataBackend, SupportsReadHead
from simpletuner.data_backend.buckets import MAX_ASPECT_RATIO, bucket_for
from simpletuner.data_backend.factory import (
    BUILDERS,
    RegisteredDataset,
    build_datasets,
    build_local_backend,
    build_source_backend,
    builder_for,
    load_sample_pixels,
)
from simpletuner.data_backend.images import load_rgb, prepare_image, read_image_size
from simpletuner.data_backend.local import LocalDataBackend
from simpletuner.data_backend.metadata import DatasetMetadata, Sample, build_metadata, caption_for
from simpletuner.data_backend.sampler import BucketSampler
from simpletuner.data_backend.video import load_clip_pixels, sample_identity

__all__ = [
    "BUILDERS",
    "IMAGE_EXTENSIONS",
    "MAX_ASPECT_RATIO",
    "BucketSampler",
    "DataBackend",
    "DatasetMetadata",
    "LocalDataBackend",
    "RegisteredDataset",
    "Sample",
    "SupportsReadHead",
    "VIDEO_FILE_EXTENSIONS",
    "bucket_for",
    "build_datasets",
    "build_local_backend",
    "build_metadata",
    "build_source_backend",
    "builder_for",
    "caption_for",
    "load_clip_pixels",
    "load_rgb",
    "load_sample_pixels",
    "prepare_image",
    "read_image_size",
    "sample_identity",
]
