"""Config errors: one pass over every problem, hints only when they help, other tools' keys named."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest
from pydantic import ValidationError

from simpletuner.configuration import ConfigError, load_config, validate_config
from simpletuner.configuration.dataset_sections import dataset_keys
from simpletuner.configuration.docs import template
from simpletuner.configuration.errors import close_match, close_matches
from simpletuner.configuration.foreign_keys import FOREIGN_KEYS, FOREIGN_VALUES
from simpletuner.configuration.schema import (
    CacheConfig,
    GH200Optimizations,
    LocalDatasetConfig,
    TrainingConfig,
)

TOP_KEYS = list(TrainingConfig.model_fields)


def _problems(raw, **kw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(raw, **kw)
    return info.value.problems


def _one(problems: list[str], prefix: str) -> str:
    found = [p for p in problems if p.startswith(prefix)]
    assert len(found) == 1, (prefix, problems)
    return found[0]


# --- one pass ---------------------------------------------------------------------------------


def test_unknown_keys_type_errors_rules_and_paths_in_one_report(make_config, tmp_path):
    raw = make_config(
        lerning_rate=1e-4,
        train_batch_size="four",
        validation_steps=5,
        resolution=72,
        pretrained_model_name_or_path=str(tmp_path / "no_model"),
    )
    raw["datasets"][0]["instance_data_dir"] = str(tmp_path / "no_images")
    problems = _problems(raw)
    _one(problems, "lerning_rate: unknown key")
    _one(problems, "train_batch_size: expected a whole number, got 'four'")
    _one(problems, "(top level): `validation_steps` is set but `validation_prompt` is not")
    _one(problems, "(top level): `resolution` 72 is not a multiple of `aspect_bucket_alignment` 16")
    _one(problems, f"pretrained_model_name_or_path: {tmp_path / 'no_model'} does not exist")
    _one(problems, f"datasets[0].instance_data_dir: {tmp_path / 'no_images'} is not a folder")
    assert len(problems) == 6, problems


def test_rule_whose_input_is_invalid_is_skipped_not_guessed(make_config):
    # resolution is invalid: the alignment rule cannot be judged, the prompt rule still can
    raw = make_config(
        resolution="big",
        validation_steps=5,
        train_batch_size=3,
        gh200_optimizations={
            "enable_batch_size_rampup": True,
            "initial_effective_batch_size": 4,
            "target_effective_batch_size": "x",
        },
    )
    problems = _problems(raw)
    assert not any("aspect_bucket_alignment" in p for p in problems), problems
    _one(problems, "resolution: expected a whole number, got 'big'")
    _one(problems, "(top level): `validation_steps` is set")
    # the ramp's target is invalid, its initial value is not: only the initial one is checked
    _one(
        problems,
        "(top level): gh200_optimizations.initial_effective_batch_size 4 is not a multiple of train_batch_size 3",
    )
    assert not any("target_effective_batch_size 'x' is not a multiple" in p for p in problems)
    _one(problems, "gh200_optimizations.target_effective_batch_size: expected a whole number")


def test_dataset_rules_run_beside_the_entrys_own_errors(make_config):
    raw = make_config(max_train_steps=None)
    raw.pop("max_train_steps")
    entry = raw["datasets"][0]
    entry.update(caption_strategy="instance_prompt", crop_styl="center", repeats=-1)
    problems = _problems(raw, check_files=False)
    _one(problems, "datasets[0].crop_styl: unknown key 'crop_styl'; did you mean 'crop_style'?")
    _one(problems, "datasets[0].repeats: must be >= 0, got -1")
    _one(problems, "datasets[0]: caption_strategy 'instance_prompt' needs `instance_prompt`")
    _one(problems, "(top level): set `max_train_steps` or `num_train_epochs`")
    assert len(problems) == 4, problems


def test_nested_ramp_rule_and_dataset_rules_with_top_level_errors(make_config):
    raw = make_config(
        mixed_precison="bf16",
        gh200_optimizations={
            "enable_batch_size_rampup": True,
            "initial_effective_batch_size": 8,
            "target_effective_batch_size": 4,
        },
    )
    raw["datasets"].append({"id": "shapes", "type": "local", "instance_data_dir": "/x", "num_frames": 5})
    problems = _problems(raw, check_files=False)
    _one(problems, "mixed_precison: unknown key 'mixed_precison'; did you mean 'mixed_precision'?")
    _one(problems, "gh200_optimizations: initial_effective_batch_size 8 is larger than target_effective_batch_size 4")
    _one(problems, "datasets[1]: `num_frames` / `frame_stride` apply to dataset_type 'video' only")
    _one(problems, "(top level): dataset ids must be unique, repeated: shapes")


def test_rule_reading_an_unreadable_dataset_entry_is_skipped(make_config):
    raw = make_config()
    raw["datasets"].append({"id": "shapes", "type": "s3", "instance_data_dir": "/x"})
    problems = _problems(raw, check_files=False)
    _one(problems, "datasets[1].type: 's3' is not one of local, in_memory")
    assert not any("unique" in p for p in problems), problems  # entry 1 unreadable: ids not comparable yet
    assert len(problems) == 1, problems


def test_each_rule_message_is_one_line(make_config):
    raw = make_config(resolution=72, validation_steps=3)
    raw["datasets"].append(dict(raw["datasets"][0]))
    problems = _problems(raw, check_files=False)
    assert len(problems) == 3, problems
    _one(problems, "(top level): dataset ids must be unique, repeated: shapes; rename all but one")


def test_valid_config_is_still_frozen_and_unchanged(make_config):
    cfg = validate_config(make_config(cuda_allocator={"backend": "cudaMallocAsync", "expandable_segments": True}))
    assert isinstance(cfg, TrainingConfig)
    assert cfg.cuda_allocator == {"backend": "cudaMallocAsync", "expandable_segments": True}
    with pytest.raises(ValidationError, match="frozen"):
        cfg.resolution = 128


def test_documented_example_is_what_a_run_prints(make_config, tmp_path):
    block = re.search(r"```\n(.*?)```", template("CONFIG.md"), re.S).group(1).strip().splitlines()
    raw = make_config(learning_rat=1e-4, network_dim=16, train_batch_size="four", validation_steps=5)
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(raw))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert lines[0] == f"4 problem(s) in {path}:"
    assert block[0] == "4 problem(s) in cfg.json:"
    assert lines[1:] == block[1:]


# --- did you mean -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "typo, meant",
    [
        ("learning_rat", "learning_rate"),
        ("lerning_rate", "learning_rate"),
        ("train_batchsize", "train_batch_size"),
        ("gradient_acumulation_steps", "gradient_accumulation_steps"),
        ("mixed_precison", "mixed_precision"),
        ("lora_rnak", "lora_rank"),
        ("Learning_Rate", "learning_rate"),
        ("num_train_epoch", "num_train_epochs"),
        ("gradient_checkpionting", "gradient_checkpointing"),
        ("gradient_acumulaton_steps", "gradient_accumulation_steps"),
    ],
)
def test_typos_get_the_right_suggestion(typo, meant):
    assert close_match(typo, TOP_KEYS) == meant


@pytest.mark.parametrize(
    "key",
    [
        "validation_noise_scheduler",
        "max_length",
        "model_name",
        "lr",
        "train_batch",
        "random_key",
        "validation_guidance_real",
    ],
)
def test_lookalikes_get_no_suggestion(key):
    assert close_match(key, TOP_KEYS) is None


def test_equally_near_keys_are_all_offered(make_config):
    assert close_matches("adam_beta", TOP_KEYS) == ["adam_beta1", "adam_beta2"]
    problem = _one(_problems(make_config(adam_beta=0.9)), "adam_beta:")
    assert "did you mean 'adam_beta1' or 'adam_beta2'?" in problem


def test_lookalike_unknown_key_message_has_no_guess(make_config):
    problem = _one(_problems(make_config(max_length=77)), "max_length:")
    assert problem == "max_length: unknown key 'max_length' (remove it or fix the spelling)"


# --- keys of other tools ----------------------------------------------------------------------


def test_simpletuner_key_we_do_not_support_says_so(make_config):
    problem = _one(_problems(make_config(distillation_config={"method": "dcm"})), "distillation_config:")
    assert problem == (
        "distillation_config: `distillation_config` is a SimpleTuner key that this trainer does not support yet: "
        "distillation is not supported: train a LoRA or a full fine-tune without it; remove it"
    )


@pytest.mark.parametrize(
    "key, value, ours",
    [
        ("checkpoint_step_interval", 500, "checkpointing_steps"),
        ("validation_guidance", 3.0, "validation_guidance_scale"),
        ("model_type", "lora", "training_type"),
        ("network_dim", 16, "lora_rank"),
        ("network_alpha", 8, "lora_alpha"),
        ("max_train_epochs", 3, "num_train_epochs"),
        ("lr", 1e-4, "learning_rate"),
        ("steps", 100, "max_train_steps"),
    ],
)
def test_renamed_keys_name_ours(make_config, key, value, ours):
    problem = _one(_problems(make_config(**{key: value})), f"{key}:")
    assert f"use `{ours}` instead" in problem
    assert "did you mean" not in problem


def test_shared_key_names_every_tool(make_config):
    problem = _one(_problems(make_config(logging_dir="logs")), "logging_dir:")
    assert "a SimpleTuner and kohya sd-scripts key with no effect here" in problem


def test_approximated_and_ignored_keys(make_config):
    problems = _problems(make_config(save_every_n_steps=100, tracker_run_name="x", job="extension"))
    assert "the nearest setting here is `checkpointing_steps`" in _one(problems, "save_every_n_steps:")
    assert "no effect here" in _one(problems, "tracker_run_name:")
    assert "config.process[0]" in _one(problems, "job:")


def test_dataset_entry_keys_of_other_tools(make_config):
    raw = make_config()
    raw["datasets"][0].update(aws_bucket_name="photos", text_embeds="alt-embeds", folder_path="/data")
    problems = _problems(raw, check_files=False)
    assert "SimpleTuner name of `instance_data_dir` (`type: aws` is `type: object_store`" in _one(
        problems, "datasets[0].aws_bucket_name:"
    )
    assert "SimpleTuner key" in _one(problems, "datasets[0].text_embeds:")
    assert "use `instance_data_dir` instead" in _one(problems, "datasets[0].folder_path:")


def test_dashed_keys_are_pointed_out(make_config):
    problems = _problems(make_config(**{"--seed": 1, "--validation_guidance": 3.0}))
    assert (
        _one(problems, "--seed:")
        == "--seed: write keys without the leading `--` (SimpleTuner's command-line style): use 'seed'"
    )
    assert "use `validation_guidance_scale` instead (and without the leading `--`)" in _one(
        problems, "--validation_guidance:"
    )


def test_keys_given_under_another_name_are_not_also_missing_or_unset(make_config):
    # SimpleTuner's `--key` style: one line per key, no "required but missing" and no rule about
    # max_train_steps / datasets being unset, since they are set, only under another name
    raw = {f"--{key}": value for key, value in make_config().items()}
    problems = _problems(raw, check_files=False)
    assert len(problems) == len(raw), problems
    assert all(p.startswith("--") and "without the leading `--`" in p for p in problems), problems
    # another tool's name of the same setting counts as set too
    raw = make_config(max_train_steps=None, steps=100)
    raw.pop("max_train_steps")
    problems = _problems(raw, check_files=False)
    assert problems == ["steps: `steps` is the ai-toolkit name of `max_train_steps`: use `max_train_steps` instead"]


def test_foreign_values_of_shared_keys(make_config):
    raw = make_config(base_model_precision="int8-quanto", model_family="sd1x")
    raw["datasets"][0]["caption_strategy"] = "instanceprompt"
    problems = _problems(raw, check_files=False)
    assert "'int8-quanto' is SimpleTuner's spelling of 'qint8': use 'qint8'" in _one(problems, "base_model_precision:")
    assert "use 'sd'" in _one(problems, "model_family:")
    assert "use 'instance_prompt'" in _one(problems, "datasets[0].caption_strategy:")


def _fields(section: str) -> set[str]:
    if section == "top":
        return set(TrainingConfig.model_fields)
    return set(dataset_keys())  # every dataset type's keys


def _is_our_key(path: str) -> bool:
    """``cache_config.cache_dir`` / ``datasets[].instance_prompt`` / ``lora_rank`` names a real key."""
    head, _, rest = path.replace("[]", "").partition(".")
    if not rest:
        return head in TrainingConfig.model_fields or head in _fields("dataset")
    nested = {"cache_config": CacheConfig, "gh200_optimizations": GH200Optimizations}
    if head == "datasets":
        return rest in _fields("dataset")
    if head == "storage_options":  # a dataset's fsspec options: a free dict (storage_options.endpoint_url)
        return head in _fields("dataset")
    return head in nested and rest in nested[head].model_fields


def test_table_never_flags_our_own_keys():
    for entry in FOREIGN_KEYS:
        assert entry.key not in _fields(entry.section), f"{entry.key} is ours: it must not be in the table"


def test_table_entries_are_consistent():
    seen: dict[tuple[str, str], tuple] = {}
    for entry in FOREIGN_KEYS:
        assert entry.kind in ("same", "approximated", "unsupported", "ignored")
        if entry.kind in ("same", "approximated"):
            assert entry.ours and _is_our_key(entry.ours), entry
        if entry.kind != "same":
            assert entry.note, entry
        assert (entry.key, entry.tool, entry.section) not in {(k, t, s) for (k, s), (t, *_) in seen.items()}
        first = seen.setdefault((entry.key, entry.section), (entry.tool, entry.ours, entry.kind))
        assert first[1:] == (entry.ours, entry.kind), f"{entry.key}: tools disagree, one message cannot cover both"


def test_foreign_values_map_onto_our_choices():
    from typing import get_args

    for value in FOREIGN_VALUES:
        if value.key in TrainingConfig.model_fields:
            allowed = get_args(TrainingConfig.model_fields[value.key].annotation)
        elif value.key == "type":
            allowed = ("local", "in_memory", "object_store")
        else:
            allowed = get_args(LocalDatasetConfig.model_fields[value.key].annotation)
        assert value.value not in allowed, value
        if value.ours is not None:
            assert value.ours in allowed, value
        else:
            assert value.note, value


# --- cuda_allocator ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [True, "True", 1, 0.5, None, [1]])
def test_fork_allocator_key_is_one_message_whatever_its_value(make_config, value):
    problems = _problems(make_config(cuda_allocator={"use_uvm": value}))
    assert len(problems) == 1, problems
    assert problems[0].startswith("cuda_allocator: use_uvm not accepted")
    assert "unified_memory" in problems[0]  # what to use instead


def test_other_fork_and_unknown_allocator_keys(make_config):
    problems = _problems(
        make_config(
            cuda_allocator={"uvm_oversubscription_ratio": "1.5", "uvm_prefetch": "on", "expandable_segment": "True"}
        )
    )
    assert len(problems) == 3, problems
    assert "--oversubscription-scale" in _one(problems, "cuda_allocator: uvm_oversubscription_ratio")
    assert "unified_memory" in _one(problems, "cuda_allocator: uvm_prefetch")
    assert "accepted keys: backend, expandable_segments" in _one(problems, "cuda_allocator: expandable_segment not")


@pytest.mark.parametrize(
    "settings",
    [
        {"backend": "cudaMallocAsync"},
        {"backend": "native"},
        {"expandable_segments": False, "max_split_size_mb": 512, "garbage_collection_threshold": 0.8},
        {"roundup_power2_divisions": 4},
        {"roundup_power2_divisions": "[256:1,512:2,1024:4,>:8]"},
        {"pinned_num_register_threads": 8, "pinned_use_cuda_host_register": True},
    ],
)
def test_allocator_values_pytorch_accepts(make_config, settings):
    assert validate_config(make_config(cuda_allocator=settings)).cuda_allocator == settings


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"backend": "cudaMalloc"}, 'backend takes "native" or "cudaMallocAsync", got \'cudaMalloc\''),
        ({"expandable_segments": "True"}, "expandable_segments takes true or false"),
        ({"max_split_size_mb": 10}, "max_split_size_mb takes a whole number of MB >= 20, got 10"),
        ({"garbage_collection_threshold": 1.5}, "garbage_collection_threshold takes a number between 0 and 1"),
        ({"roundup_power2_divisions": 3}, "roundup_power2_divisions takes a power of 2"),
        ({"pinned_num_register_threads": 256}, "pinned_num_register_threads takes a power of 2 up to 128"),
    ],
)
def test_allocator_values_pytorch_refuses(make_config, settings, expected):
    problems = _problems(make_config(cuda_allocator=settings))
    assert problems == [f"cuda_allocator: {expected}"] or (len(problems) == 1 and expected in problems[0]), problems


def test_config_reference_explains_error_reporting():
    doc = (Path(__file__).resolve().parents[1] / "documentation" / "CONFIG.md").read_text()
    assert "## How problems are reported" in doc and "## Keys from other tools" in doc
    assert "| `validation_torch_compile` | SimpleTuner | top level |" in doc
