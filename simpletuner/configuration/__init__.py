"""Configuration: schema, loading, error formatting."""

from simpletuner.configuration.errors import ConfigError
from simpletuner.configuration.loader import LoadedConfig, load_config, validate_config
from simpletuner.configuration.schema import CacheConfig, LocalDatasetConfig, TrainingConfig

__all__ = [
    "CacheConfig",
    "ConfigError",
    "LoadedConfig",
    "LocalDatasetConfig",
    "TrainingConfig",
    "load_config",
    "validate_config",
]
