"""Generate documentation/CONFIG.md from the schema and documentation/MIGRATING_FROM_SIMPLETUNER.md from
the SimpleTuner dialect table: ``python -m simpletuner.configuration.docs``.

A test regenerates both and compares, so the references never drift from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from simpletuner.configuration import dialect, dialect_values
from simpletuner.configuration.dataset_sections import (
    AspectBucket,
    MetadataFileOptions,
    ObjectStoreDatasetConfig,
    ParquetDatasetConfig,
    WebDatasetConfig,
)
from simpletuner.configuration.foreign_keys import FOREIGN_KEYS, FOREIGN_VALUES
from simpletuner.configuration.schema import (
    CacheConfig,
    GH200Optimizations,
    InMemoryDatasetConfig,
    InMemoryOptions,
    LocalDatasetConfig,
    TrainingConfig,
)
from simpletuner.configuration.sections import (
    Augmentations,
    LycorisModuleOptions,
    LycorisOptions,
    LycorisPreset,
)

HEADER = """# Configuration reference

A run is configured by one JSON file: `simpletuner train --config cfg.json` or
`accelerate launch simpletuner/train.py --config cfg.json`. Unknown keys are rejected and
every problem is reported at once, with its path and the fix, before any model loads.
Any key can be overridden on the command line: `--set max_train_steps=100`,
`--set cache_config.cache_dir=/scratch/cache` (values are parsed as JSON when they can be).

**Relative paths are taken from the config file's folder**, not from the folder you run in:
`pretrained_model_name_or_path`, `output_dir`, `cache_config.cache_dir`, `resume_from_checkpoint`,
`data_backend_config` and each dataset's `instance_data_dir` (also those of a `data_backend_config`
file), given relative, and the defaults `output` and `cache`, resolve against the folder holding the
config, so the same config run from another folder writes to and reads from the same places. `--set`
values follow the same rule. A relative `pretrained_model_name_or_path` of the form `org/name` that is
not a folder beside the config stays a hub id; any other that is not there is refused, naming the
config's folder (and the working directory, when the folder is there instead). (Earlier, all but
`data_backend_config` were taken from the working directory, `pretrained_model_name_or_path` the
longest: a config that relied on that now points elsewhere; give absolute paths to be sure.)

`model_family` may be left out: it is then read from the model folder's `model_index.json`.

This file is generated from `simpletuner/configuration/schema.py` and
`simpletuner/configuration/foreign_keys.py` by `python -m simpletuner.configuration.docs`;
a test fails when they differ.
"""

ERRORS = """## How problems are reported

The config is checked as a whole before anything loads, and one run reports every problem it
finds, one line each with the key's path and the fix: unknown keys, wrong types and values,
rules between keys (`validation_steps` without `validation_prompt`, a `resolution` that is not
a multiple of `aspect_bucket_alignment`, ...) and paths that do not exist. A rule whose own
input is wrong is checked once that input is fixed, so no line is a consequence of another.

```
4 problem(s) in cfg.json:
  - train_batch_size: expected a whole number, got 'four'
  - learning_rat: unknown key 'learning_rat'; did you mean 'learning_rate'? (remove it or fix the spelling)
  - network_dim: `network_dim` is the kohya sd-scripts name of `lora_rank`: use `lora_rank` instead
  - (top level): `validation_steps` is set but `validation_prompt` is not (nor `validation_prompts`): add a prompt or remove validation_steps
```

- **Did you mean**: offered only when the unknown key reads as a typo of one of ours (a letter
  missing, added, swapped or changed, or underscores moved: `train_batchsize`); a key that only
  looks alike (`model_name` beside `model_family`) gets no guess.
- **SimpleTuner configs** are not errors: a config file with `--key` keys or SimpleTuner's own keys
  is translated, with the same meaning, before it is checked (documentation/MIGRATING_FROM_SIMPLETUNER.md;
  `simpletuner convert` writes the native equivalent).
- **Keys of other tools** in a native config (kohya sd-scripts, ai-toolkit, and SimpleTuner keys
  given through `--set` or an API dict) are named as such, with the key that does the same job here
  or a note on what happens instead (table below); a few of their values of keys we share are
  recognised too (`base_model_precision: "int8-quanto"` is our `qint8`). Nothing of theirs is
  translated there: the message says what to write.
- **`cuda_allocator`**: one line per key PyTorch would refuse, whatever the value's type:
  `use_uvm` and other keys of patched builds with what to use instead, other unknown keys with
  the list PyTorch accepts, known keys with the values they take.
"""


BUCKETS = """### How a dataset picks its training size

Each image trains at a *bucket* (width x height). A dataset picks buckets one of two ways:

- **This trainer's own way** (the default: `crop` and `resolution_type` both unset): the bucket's area
  is about `resolution`², its aspect as close to the image's as sides in multiples of
  `aspect_bucket_alignment` allow (at most 4:1); the image is resized, aspect kept, just enough to
  cover the bucket and only the overshoot is cropped at `crop_style`. `minimum_image_size` is the
  shorter side in pixels.
- **SimpleTuner's way** (as soon as `crop` or `resolution_type` is set; a translated SimpleTuner
  config always sets them): `resolution_type` gives the unit of `resolution`, `minimum_image_size`,
  `maximum_image_size` and `target_downsample_size` (`pixel`: the shorter side; `area`: megapixels;
  `pixel_area`: a side whose square is the area). The aspect is rounded to 2 decimals and each side
  to a multiple of `aspect_bucket_alignment`. `crop: false` keeps aspect buckets (only the overshoot
  cropped); `crop: true` takes the bucket from `crop_aspect`: `square`, `preserve` (the image's
  aspect), `closest` / `random` (from `crop_aspect_buckets`), and first downsamples images above
  `maximum_image_size` to `target_downsample_size`, so a large photo keeps its scene.

A latent's cache key holds its bucket, crop and any downsampled size, so changing these settings
never serves an old crop. When the size and aspect rules leave no image, the run stops before any
model loads, naming how many each rule skipped, the largest skipped image and the value that keeps it.

Example (square 1024 crops out of photos first brought down to about 1280² pixels):

```json
{"id": "photos", "type": "local", "instance_data_dir": "/data/photos",
 "resolution": 1024, "resolution_type": "pixel_area", "crop": true, "crop_aspect": "square",
 "crop_style": "random", "maximum_image_size": 1536, "target_downsample_size": 1280,
 "minimum_image_size": 768, "minimum_aspect_ratio": 0.5, "maximum_aspect_ratio": 3.0}
```
"""


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return "object"
        return getattr(annotation, "__name__", str(annotation))
    args = [a for a in get_args(annotation) if a is not type(None)]
    name = getattr(origin, "__name__", str(origin))
    if name == "Literal":
        return " \\| ".join(f"`{a}`" for a in get_args(annotation))
    if name in ("Union", "UnionType", "Optional"):
        return " \\| ".join(_type_name(a) for a in args)
    if name == "Annotated":
        return _type_name(args[0])
    if name == "list":
        return f"list of {_type_name(args[0])}" if args else "list"
    return name


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    if field.default_factory is not None:
        return "(object)"
    return "`null`" if field.default is None else f"`{field.default!r}`".replace("'", '"')


def model_table(model: type[BaseModel]) -> str:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
    return "\n".join(rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def foreign_tables() -> str:
    """The keys and values of other tools' configs that errors recognise (foreign_keys.py)."""
    rows = [
        "## Keys from other tools\n",
        "What an error says for a key of another trainer's config. `same`: our key means the same, use it "
        "instead; `approximated`: the nearest setting here, the note says what differs; `unsupported`: nothing "
        "here does it yet; `ignored`: irrelevant here.\n",
        "| key | tool | where | here | kind | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for e in FOREIGN_KEYS:
        where = "top level" if e.section == "top" else "dataset entry"
        ours = f"`{e.ours}`" if e.ours else "—"
        rows.append(f"| `{e.key}` | {e.tool} | {where} | {ours} | {e.kind} | {_cell(e.note)} |")
    rows += [
        "",
        "Values of keys we share, spelled differently there:\n",
        "| key | value | tool | here | note |",
        "| --- | --- | --- | --- | --- |",
    ]
    for v in FOREIGN_VALUES:
        ours = f"`{v.ours}`" if v.ours else "—"
        rows.append(f"| `{v.key}` | `{v.value}` | {v.tool} | {ours} | {_cell(v.note)} |")
    return "\n".join(rows)


def render() -> str:
    parts = [
        HEADER,
        ERRORS,
        "## Top-level keys\n",
        model_table(TrainingConfig),
        "\n## `cache_config`\n",
        model_table(CacheConfig),
        "\n## `gh200_optimizations`\n",
        model_table(GH200Optimizations),
        "\n## `augmentations`\n",
        model_table(Augmentations),
        "\n## `lycoris`\n",
        model_table(LycorisOptions),
        "\n### `lycoris.apply_preset`\n",
        "LyCORIS' own preset format (as in a SimpleTuner `lycoris_config.json`): which modules get an adapter.\n",
        model_table(LycorisPreset),
        "\n#### An entry of `module_algo_map` / `name_algo_map`\n",
        model_table(LycorisModuleOptions),
        "\n## Dataset entries (`datasets[]`)\n",
        "Each entry is an object whose `type` picks the storage backend.\n",
        BUCKETS,
        '### `type: "local"`\n',
        model_table(LocalDatasetConfig),
        '\n### `type: "in_memory"`\n',
        "The same keys as `local`, plus `in_memory`:\n",
        model_table(InMemoryDatasetConfig),
        "\n#### `in_memory`\n",
        model_table(InMemoryOptions),
        '\n### `type: "object_store"`\n',
        "Files in an object store, read through fsspec when needed: the same keys as `local`, with "
        "`instance_data_dir` a URL (`s3://bucket/prefix`; `gs://`, `az://`, `https://` with their fsspec package). "
        "Listed once at start-up (sizes and ETags kept); each read is retried on transient failures. S3 needs the "
        "`s3` extra (`pip install -e '.[s3]'` in the checkout). `in_memory` takes such a URL too, with the same "
        "`storage_options` / `max_retries` / `retry_backoff_seconds`, and stages every object in RAM.\n",
        model_table(ObjectStoreDatasetConfig),
        '\n### `type: "webdataset"`\n',
        "Tar shards read in place: the same keys as `local`, with `instance_data_dir` the folder of shards. Every "
        "file is `<shard>/<member>` (`shard-000.tar/0001.jpg`); `dataset_type: video` and edit pairs are refused.\n",
        model_table(WebDatasetConfig),
        '\n### `type: "parquet"`\n',
        "Parquet files of image bytes and captions (a Hugging Face dataset's files), read in place: the same keys as "
        "`local`, plus the columns. Every row is `<file>/<name>` (`part-0.parquet/000123.png`), its caption "
        "`<file>/<name stem>.txt`; `dataset_type: video` and edit pairs are refused.\n",
        model_table(ParquetDatasetConfig),
        "\n#### `parquet` / `csv` / `jsonl` (caption files)\n",
        "The sub-table of `caption_strategy` `parquet`, `csv` or `jsonl` (either backend):\n",
        model_table(MetadataFileOptions),
        "\n#### An entry of `crop_aspect_buckets` (weighted form)\n",
        model_table(AspectBucket),
        "",
        foreign_tables(),
        "",
    ]
    return "\n".join(parts)


MIGRATING_HEADER = """# Bringing a SimpleTuner run

A SimpleTuner `config/config.json` (with its `multidatabackend.json`) trains here as it is:

```bash
cd /path/you/run/simpletuner/from          # its paths are relative to this folder
simpletuner train --config config/config.json
accelerate launch simpletuner/train.py --config config/config.json   # several processes
simpletuner estimate --config config/config.json                      # memory, before training
simpletuner convert config/config.json --out native.json              # the same run as a native config
```

The config is recognised by itself (a key written `--key`, or a key of SimpleTuner's that is not one of
ours) and translated before anything else is checked; the start of the log says so (`read as a
SimpleTuner config: N keys mapped, ...`) and lists what each key became. `simpletuner convert`
prints the same report and writes the native config, datasets inlined; training that file is the
same run.

How the translation keeps the meaning:

- **Every key of SimpleTuner's dialect is in one table** (below; `DIALECT` in
  `simpletuner/configuration/dialect.py`, built from `dialect_keys.py`, `dialect_dataset_keys.py` and `dialect_tail.py`). `same`: mapped
  onto our key with the same meaning, and a test holds the translation to figures computed from SimpleTuner's
  own code at the commit the table was written from (`tests/test_dialect_same_rows*.py`,
  `tests/test_dialect_meaning.py`; a row no test backs is `approximated`). `approximated`: mapped,
  and a warning at start says exactly what differs. `ignored`: no effect on what is trained here
  (hub uploads turned off, web-UI and logging settings, attention backends); listed once at start.
  `unsupported`: the run stops before any model loads, naming the key, why, and what to do. An
  unsupported key set to a value that does nothing (`false`, `null`, `0`, `""`, or SimpleTuner's
  default) is listed with the ignored ones: published examples spell out switches that are off.
- **Values** are read as SimpleTuner reads them: `"true"` / `"false"`, numbers written as strings
  (`"1e-4"`), `--` in front of keys. SimpleTuner's spellings of values become ours (table below).
- **SimpleTuner's defaults**: where a key is left out and SimpleTuner's default differs from ours,
  SimpleTuner's is written into the translation (table below), so a config that relied on
  SimpleTuner's `train_batch_size: 4` or `max_grad_norm: 2.0` with value clipping gets them here.
- **Paths** are taken from the working directory, as SimpleTuner does, and written absolute.
  `data_backend_config` is looked for in the working directory, then beside the config file.
  `{model_family}` in a cache path is SimpleTuner's family name (`sd1x`, `flux`, ...), as there.
- **Two keys for one setting** (`checkpoint_step_interval` and `checkpointing_steps`, `--seed` and
  `seed`) with different values stop the run naming both.
- **`model_flavour`** names a hub model; nothing is downloaded here, so `pretrained_model_name_or_path`
  must be a local diffusers folder. Without one, the run stops with the hub id the flavour stands for
  and the `huggingface-cli download` command to run on a machine with network. Wan 2.2 flavours ending
  in `-high` / `-low` set `train_stages`.
- **Qwen-Image-Edit** (`model_family: qwen_image`, `model_flavour: edit-v1`, a local Qwen-Image-Edit
  folder): a training dataset's `conditioning_data` names a `dataset_type: conditioning` entry, whose
  `instance_data_dir` becomes the dataset's `conditioning_data_dir` (source images paired by file name);
  that entry is not a dataset here. `conditioning_type: reference_strict` keeps its meaning (the source
  takes its edited image's crop). `conditioning_image_embeds` entries and keys are ignored: the edit
  prompt embedding is cached with the text embeddings, keyed by caption and source image. Edit Plus
  (`edit-v2`, `edit-v2+`, `edit-v3`: several sources per sample), several conditioning datasets for one
  dataset, other conditioning types (`controlnet`, `mask`, ...) and a conditioning entry no dataset
  names stop the run, saying why.
- **Datasets**: `dataset_type: text_embeds` entries are not datasets here: the default one's `cache_dir`
  becomes `cache_config.text_cache_dir`. Top-level `resolution_type`, `minimum_image_size`,
  `maximum_image_size`, `target_downsample_size` and `caption_strategy` are each dataset's default, as in
  SimpleTuner; a dataset that leaves out `crop`, `crop_aspect` or `crop_style` gets SimpleTuner's
  defaults for them.
- **Learning-rate schedules** are SimpleTuner's. Its `cosine` (and `cosine_with_warmup`) is its own class,
  written `simpletuner_cosine` here: no warm-up ramp, from `learning_rate` down to `lr_end` (4e-7 unless set)
  and back up, a half-period of `lr_warmup_steps` optimizer steps (1000 / processes when that is 0).
  `constant` with `lr_warmup_steps` > 0 becomes `constant_with_warmup`, as its argument parsing does.
  `polynomial` decays to `lr_end` 4e-7 with `lr_power` 0.8 unless set. `cosine_with_restarts` stops the run:
  SimpleTuner's never leaves the peak learning rate (use `constant` for that, or `cosine`). `lr_end` /
  `lr_power` on a schedule that does not read them are listed as ignored.
- **Optimizers** are built as SimpleTuner builds them: each one's own defaults (`adamw_bf16` eps 1e-6;
  `prodigy` betas (0.9, 0.99), weight decay 0; optimi's AdamW / Adam betas (0.9, 0.99), eps 1e-6, weight
  decay 0; optimi's SGD without momentum) where `optimizer_config` does not set them, and
  `optimizer_beta1` + `optimizer_beta2` (both or neither) over those. `adam_beta1`, `adam_beta2`,
  `adam_epsilon` and `adam_weight_decay` are ignored: SimpleTuner reads them only for DeepSpeed's optimizer.
- **Settings SimpleTuner's model code forces**, whatever the config says, are forced here too, and a
  warning names each value of the config they replace (`SimpleTuner setting forced: ...`): the bucket
  alignment per family (64 px; 32 for Wan and Qwen-Image, 64 for Wan 2.2 TI2V-5B), zero-terminal-SNR betas
  for every `sd2x` model (`rescale_betas_zero_snr`), SD3's T5 length 154 (`t5_max_length`; a larger
  `tokenizer_max_length` is capped unless `i_know_what_i_am_doing`), Wan 2.2 I2V A14B's flow shift 5.0 with
  40 validation steps at guidance 3.5 (`i2v-14b-2.2-high` / `-low`), FluxBooru's guidance 3.5.
  `libreflux` stops: SimpleTuner trains it with attention-masked T5 tokens, which this trainer does not.
- **Validation and seed.** A config with a `validation_prompt` validates every 100 steps unless
  `validation_step_interval` says otherwise, as there. SimpleTuner seeds nothing unless `seed` is set;
  here an unset seed is 42 (said at start): random crops are drawn once per image from the seed and the
  latent cache is built on them, and a fixed seed is what lets a run resume exactly.
- **Flow-matching families** (sd3, flux, wan): SimpleTuner draws noise levels as
  `sigmoid(N(0, 1) * flow_sigmoid_scale)`; the translation writes that as `timestep_sampling:
  logit_normal` with `logit_std: flow_sigmoid_scale` unless `flow_use_uniform_schedule` is on.

## Where the meaning differs (each is also a warning or a table note)

- **Buckets.** A dataset that sets `crop` or `resolution_type` (every translated one does) uses
  SimpleTuner's bucket formulas: aspect rounded to 2 decimals, each side rounded to a multiple of
  `aspect_bucket_alignment` (SimpleTuner's 64-pixel default is ours too), the near-1/2/4-megapixel
  squares snapped as there. `maximum_image_size` / `target_downsample_size` downsample only images
  above the maximum, as SimpleTuner's documentation says (its code resizes nearly every image);
  `minimum_aspect_ratio` / `maximum_aspect_ratio` compare the image's own aspect (SimpleTuner
  compares the bucket's, 1.0 under square crops). Random crops and `crop_aspect: random` are drawn
  once per image from the seed, so each image keeps one crop for the run. Before a crop the image is
  resized to cover its bucket with the resized side rounded; SimpleTuner truncates it (a 200x120 image
  cropped to 64 px is resized to 107x64 here, 106x64 there).
- **Sampling between datasets.** `probability` weights each dataset by probability x its batches
  (SimpleTuner's default `auto-weighting`) for the whole epoch; an epoch keeps its length (every
  dataset's batches added up). In SimpleTuner a dataset that runs out leaves the draw until all have.
  `probability: 0` leaves a dataset out (one of SimpleTuner's readers turns 0 into 1.0).
- **Captions.** Caption dropout is decided by a hash of the seed, the step and the sample, so a resumed
  run drops the same captions; SDXL's size conditioning is not zeroed for dropped captions.
  `caption_strategy: filename` is SimpleTuner's text (the file stem, `_` as a space, nothing removed).
  A caption file of several lines is several captions, one drawn per step (empty lines dropped), unless
  the dataset sets `disable_multiline_split: true`; SimpleTuner draws with Python's unseeded `random`,
  here the draw is a hash of the seed, the step and the sample, so a resumed run draws the same lines.
- **SDXL size and crop conditioning** follows diffusers' SDXL script: the image's size before resizing
  and its crop offset (said at start). SimpleTuner passes the resized size before the crop as the
  original size.
- **Unreadable images** are skipped and listed at the end of the scan and of the cache fill, as
  SimpleTuner skips them; the translation writes `max_bad_image_fraction: 1.0`, so a dataset stops the
  run only when none of it can be read.
- **Regularisation data** (`is_regularisation_data`) trains a LoRA or LyCORIS adapter towards the
  frozen base model's own prediction, as SimpleTuner's trainer does (its documentation says standard
  LoRA is not supported; here both are). A full fine-tune uses the plain target, as there.
- **Edit pairs.** `conditioning_type: reference_loose`: SimpleTuner sizes and crops a loose reference
  on its own; here every source is resized to its edited image's size and takes the same crop, and a
  pair whose aspect ratios are more than 2% apart stops the run, naming it. Pairing is by relative path
  and file stem (`sub/cat.png` pairs with `sub/cat.jpg` in the source folder); SimpleTuner needs the exact
  file name. A conditioning entry's own `resolution`, `crop*`, `cache_dir_vae` and caption keys are
  ignored: each source follows its edited image. Validation edits `validation_image` (one source per
  prompt), else the first training pair's source.
- **Optimizers.** Adapters and full fine-tunes train fp32 weights here, so `adamw_bf16` is exact AdamW
  (with its eps 1e-6).
  `prodigy` is prodigyopt's Prodigy (SimpleTuner's is prodigy-plus-schedule-free), run at learning
  rate 1.0 as SimpleTuner passes it; `optimizer_config` settings of prodigy-plus only are refused.
- **EMA.** A `cpu` EMA always updates on the CPU (SimpleTuner's `ema_cpu_only`); the decay rule,
  warm-up and interval are SimpleTuner's.
- **Validation.** Unset `validation_resolution` is the training `resolution`, square. Comparison
  images of `ema_validation: comparison` are separate `_ema` files and extra grid columns.
- **Caches** are this trainer's own shard stores: latents SimpleTuner cached are not reused.
- **Noise offset** needs `offset_noise: true` there; here any `noise_offset` above 0 is on (the
  translation writes it only when `offset_noise` is on, and never for flow families, as SimpleTuner).

This file is generated from the dialect table by `python -m simpletuner.configuration.docs`;
a test fails when they differ.
"""


def _here(ours: str | None) -> str:
    return f"`{ours}`" if ours else "—"


def dialect_tables() -> str:
    """The SimpleTuner dialect: defaults, value spellings, flavours (dialect_values.py) and every key (DIALECT)."""
    rows = ["## SimpleTuner defaults written into the translation\n", "| key | SimpleTuner default |", "| --- | --- |"]
    for key, value in dialect_values.SIMPLETUNER_DEFAULTS.items():
        rows.append(f"| `{key}` | `{value!r}` |".replace("'", '"'))
    for key, value in dialect_values.SIMPLETUNER_DATASET_DEFAULTS.items():
        rows.append(f"| dataset `{key}` | `{value!r}` |".replace("'", '"'))
    rows += ["", "## Model families and flavours\n", "| SimpleTuner family | here | flavours (hub model) |"]
    rows.append("| --- | --- | --- |")
    for family, ours in dialect_values.FAMILIES.items():
        flavours = ", ".join(f"`{f}` ({hub})" for f, hub in dialect_values.FLAVOURS.get(family, {}).items())
        rows.append(f"| `{family}` | {_here(ours)} | {flavours or '—'} |")
    unsupported = "; ".join(f"`{marker}...`: {why}" for marker, why in dialect_values.FLAVOUR_UNSUPPORTED.items())
    rows += ["", f"Flavours that stop the run: {unsupported}.", ""]
    rows += ["## Value spellings\n", "| key | SimpleTuner value | here |", "| --- | --- | --- |"]
    for key, table in dialect_values.VALUE_TABLES.items():
        for value, ours in table.items():
            rows.append(f"| `{key}` | `{value}` | {_here(ours) if ours is not None else 'unsupported'} |")
    for section, title in (("top", "Top-level keys"), ("dataset", "Dataset entries (`multidatabackend.json`)")):
        rows += ["", f"## {title}\n", "| key | kind | here | note |", "| --- | --- | --- | --- |"]
        for e in sorted((e for e in dialect.DIALECT if e.section == section), key=lambda e: e.key):
            rows.append(f"| `{e.key}` | {e.kind} | {_here(e.ours)} | {_cell(e.note)} |")
    return "\n".join(rows)


def render_migrating() -> str:
    return "\n".join([MIGRATING_HEADER, dialect_tables(), ""])


#: Each generated document and its renderer.
DOCUMENTS = {"CONFIG.md": render, "MIGRATING_FROM_SIMPLETUNER.md": render_migrating}


def main(argv: list[str] | None = None) -> int:
    """``python -m simpletuner.configuration.docs [FOLDER]``: write the generated documents into FOLDER."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m simpletuner.configuration.docs",
        description=f"Write {' and '.join(DOCUMENTS)} from the config schema and the SimpleTuner dialect table.",
    )
    parser.add_argument("folder", nargs="?", default="documentation", help="where to write them (default: %(default)s)")
    folder = Path(parser.parse_args(argv).folder)
    if not folder.is_dir():
        parser.error(f"{folder} is not a folder")
    for name, renderer in DOCUMENTS.items():
        out = folder / name
        out.write_text(renderer())
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
