"""Which datasets a run trains on, and the place-holders of per-dataset cache folders.

A dataset entry with ``disabled: true`` or ``probability: 0`` stays in the config (it is still
validated, so a typo in it is still refused) but is left out of the run: not scanned, not cached,
not sampled. :func:`trained_datasets` is the one filter every reader of ``config.datasets`` that
touches data uses (the dataset factory, ``simpletuner cache``, the memory planner).

``datasets[].cache_dir_vae`` and ``cache_config.text_cache_dir`` may name the run's model family,
the dataset's id and the output folder as ``{model_family}``, ``{id}`` and ``{output_dir}``
(SimpleTuner's place-holder names); :func:`fill_template` replaces them when the run opens its caches.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING, Iterable

from simpletuner.configuration.families import FAMILY_NAMES

if TYPE_CHECKING:
    from simpletuner.configuration.dataset_sections import FolderDatasetConfig
    from simpletuner.configuration.schema import TrainingConfig

#: Place-holders a cache folder may hold, and what each becomes.
TEMPLATE_NAMES: dict[str, str] = {
    "model_family": f"the run's model family ({', '.join(FAMILY_NAMES)})",
    "id": "the dataset's `id` (datasets[].cache_dir_vae only)",
    "output_dir": "the run's `output_dir`",
}
#: The place-holders ``cache_config.text_cache_dir`` may hold (it belongs to no dataset).
TEXT_TEMPLATE_NAMES = ("model_family", "output_dir")


def template_fields(value: str) -> list[str]:
    """The place-holder names in ``value`` (``{{`` and ``}}`` are literal braces).

    Raises:
        ValueError: an unmatched brace, or a place-holder with a format spec or an attribute.
    """
    names = []
    for _, name, spec, conversion in string.Formatter().parse(value):
        if name is None:
            continue
        if spec or conversion or not name.isidentifier():
            raise ValueError(f"{{{name}}} is not a plain place-holder")
        names.append(name)
    return names


def template_problem(value: str, allowed: Iterable[str] = tuple(TEMPLATE_NAMES)) -> str | None:
    """Why ``value`` is not a usable cache folder template, or None."""
    allowed = tuple(allowed)
    listed = ", ".join("{" + name + "}" for name in allowed)
    try:
        names = template_fields(value)
    except ValueError as exc:
        return (
            f"{value!r} has a brace that is not a place-holder ({exc}): the place-holders are {listed}; "
            "write a literal brace as {{ or }}"
        )
    unknown = sorted({name for name in names if name not in allowed})
    if unknown:
        return f"{value!r} names {', '.join('{' + n + '}' for n in unknown)}, which is not one of {listed}"
    return None


def fill_template(value: str, *, model_family: str, output_dir: str, dataset_id: str | None = None) -> str:
    """``value`` with its place-holders replaced (checked by :func:`template_problem` at load time)."""
    names = {"model_family": model_family, "output_dir": str(output_dir)}
    if dataset_id is not None:
        names["id"] = dataset_id
    return value.format(**names)


def is_trained(dataset: FolderDatasetConfig) -> bool:
    """False when the entry is ``disabled`` or has ``probability`` 0: the run leaves it out."""
    return not dataset.disabled and dataset.probability > 0


def left_out_reason(dataset: FolderDatasetConfig) -> str:
    """Why :func:`is_trained` is False for ``dataset``, for the log."""
    return "disabled: true" if dataset.disabled else "probability 0"


def trained_datasets(config: TrainingConfig) -> list[FolderDatasetConfig]:
    """The entries of ``config.datasets`` the run trains on, in config order."""
    return [dataset for dataset in config.datasets or [] if is_trained(dataset)]
