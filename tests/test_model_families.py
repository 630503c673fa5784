"""The family table of the configuration (``configuration/families.py``) and the model layer's
registry (``models.MODEL_FAMILIES``) describe the same families the same way."""

from __future__ import annotations

from typing import get_args

import simpletuner.models as models
from simpletuner.configuration import TrainingConfig
from simpletuner.configuration.families import FAMILIES, FAMILY_LATENT_GRID, FAMILY_NAMES, FLOW_MATCHING_FAMILIES
from simpletuner.configuration.model_folder import PIPELINE_FAMILIES
from simpletuner.models import FAMILY_VARIANTS, MODEL_FAMILIES
from simpletuner.models.flow import FlowMatchingSpec


def test_config_and_models_list_the_same_families():
    assert list(MODEL_FAMILIES) == list(FAMILIES) == list(FAMILY_NAMES)
    assert get_args(TrainingConfig.model_fields["model_family"].annotation) == FAMILY_NAMES
    assert set(PIPELINE_FAMILIES.values()) == set(FAMILY_NAMES)  # each family has its folder class(es)
    assert set(FAMILY_VARIANTS) <= set(FAMILY_NAMES)


def test_each_spec_matches_its_row():
    # every spec class the package names (a family's module is imported on lookup, so __subclasses__ would
    # list only the variants some earlier test happened to import)
    spec_classes = [getattr(models, n) for n in models.__all__ if n.endswith("Spec")]
    for name, cls in MODEL_FAMILIES.items():
        row = FAMILIES[name]
        assert cls.family == name
        assert issubclass(cls, FlowMatchingSpec) == row.flow_matching == (name in FLOW_MATCHING_FAMILIES), name
        assert cls.latent_patch == row.latent_grid[1] and FAMILY_LATENT_GRID[name] == row.latent_grid, name
        variants = [cls, *(v for v in spec_classes if cls in v.__bases__)]  # as cls.__subclasses__() was
        assert any(v.has_experts for v in variants) == row.experts, name
        # what a hub download fetches: every folder some variant of the family loads, and nothing else
        assert set(row.components) == {c for v in variants if v.family == name for c in v.components}, name
