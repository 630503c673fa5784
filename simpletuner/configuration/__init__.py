"""Configuration: schema, loading, error formatting."""

from simpletuner.configuration.errors import ConfigError
from simpletuner.configuration.loader import LoadedConfig, load_config, validate_config
from simpletuner.configuration.schema import (
    CacheConfig,
    GH200Optimizations,
    InMemoryDatasetConfig,
    InMemoryOptions,
    LocalDatasetConfig,
    TrainingConfig,
)

__all__ = [
    "CacheConfig",
    "ConfigError",
    "GH200Optimizations",
    "InMemoryDatasetConfig",
    "InMemoryOptions",
    "LoadedConfig",
    "LocalDatasetConfig",
    "TrainingConfig",
    "load_config",
    "validate_config",
]
