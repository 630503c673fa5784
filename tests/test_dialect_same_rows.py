"""Every `same` row of the SimpleTuner dialect table, backed by figures taken from SimpleTuner's code.

Each row of :data:`TOP_ROWS` (and of ``DATASET_ROWS`` in test_dialect_same_rows_datasets.py) names the
SimpleTuner source lines that give the key its meaning (paths inside SimpleTuner's repository at
``SIMPLETUNER_COMMIT``), says in one sentence what SimpleTuner does with it, and lists config fragments
with the native values the translation must write for them. The figures were computed once from
SimpleTuner's own code (its argument parser on the fragment, its functions on the inputs named) and are
written here as numbers, not as copied code. Where our native meaning of a key is a behaviour (a decay
rule, a loss threshold, a bucket size), ``also`` names the test that checks that behaviour against
SimpleTuner's figures. :func:`test_every_same_row_has_evidence` keeps the table honest: a `same` row with
no evidence here fails, so it is `approximated` until one is written.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import DDPMScheduler
from PIL import Image

from simpletuner.configuration import validate_config
from simpletuner.configuration.simpletuner import translate as dialect
from simpletuner.configuration.simpletuner.facts import SIMPLETUNER_COMMIT
from simpletuner.models import losses, noise
from simpletuner.training.ema import EMA, decay_at

TESTS = Path(__file__).parent
#: A checkout of SimpleTuner at SIMPLETUNER_COMMIT, when present: cited lines are checked to exist.
SIMPLETUNER_SOURCE = Path(os.environ.get("SIMPLETUNER_SOURCE", "/work/st"))

#: Rows whose evidence is written with the work that changes them (none: every `same` row has evidence).
LEAD_OWNED: frozenset[tuple[str, str]] = frozenset()

UNSET = object()  # the native config has no such key
MEANING = "tests/test_dialect_meaning.py::"
MORE = "tests/test_optimizers_more.py::"
GUIDANCE = "tests/test_flux_guidance_and_sampling.py::"


@dataclass(frozen=True)
class Row:
    """Evidence for one `same` row: SimpleTuner's lines, what it does, and fragments -> native figures.
    In ``expect``, dotted keys reach nested tables and ``{cwd}`` stands for SimpleTuner's working directory."""

    where: tuple[str, ...]
    does: str
    cases: tuple[tuple[dict, dict], ...]
    family: str = "sd1x"
    also: tuple[str, ...] = ()  # "tests/test_x.py::test_name": the behaviour, checked against SimpleTuner's figures


def _row(where: str, does: str, *cases: tuple[dict, dict], family: str = "sd1x", also: str = "") -> Row:
    return Row(tuple(where.split()), does, cases, family, tuple(also.split()))


#: The config every top-level case starts from (optimizer and precision chosen so no other row's
#: approximation applies; one local dataset of one image).
BASE = {
    "model_type": "lora",
    "pretrained_model_name_or_path": "model",
    "optimizer": "optimi-adamw",
    "mixed_precision": "no",
    "max_train_steps": 10,
    "num_train_epochs": 0,
    "data_backend_config": "multidatabackend.json",
}

R = "simpletuner/simpletuner_sdk/server/services/field_registry/sections/"
H = "simpletuner/helpers/"

TOP_ROWS: dict[str, Row] = {
    "model_type": _row(
        f"{R}model.py:196 {H}training/trainer.py:3670",
        "`lora` trains an adapter on the frozen model, `full` every weight",
        ({"model_type": "lora"}, {"training_type": "lora"}),
        ({"model_type": "full"}, {"training_type": "full"}),
    ),
    "model_family": _row(
        f"{H}models/sd1x/model.py:444 {H}models/sdxl/model.py:716 {H}models/flux/model.py:1504",
        "picks the model class: sd1x is Stable Diffusion 1.x, sdxl SDXL, flux Flux",
        ({"model_family": "sd1x"}, {"model_family": "sd"}),
        ({"model_family": "sdxl"}, {"model_family": "sdxl"}),
        ({"model_family": "flux"}, {"model_family": "flux"}),
    ),
    "pretrained_model_name_or_path": _row(
        f"{R}model.py:122 {H}models/common.py:2315",
        "the model folder, read from the working directory",
        ({"pretrained_model_name_or_path": "model"}, {"pretrained_model_name_or_path": "{cwd}/model"}),
    ),
    "model_flavour": _row(
        f"{H}models/common.py:1214 {H}models/common.py:1222 {H}models/common.py:1228 {H}models/sd1x/model.py:76 "
        f"{H}models/sd1x/model.py:80",
        "with no pretrained_model_name_or_path, the model is HUGGINGFACE_PATHS[model_flavour] (the family's "
        "DEFAULT_MODEL_FLAVOUR when the flavour is unset too), a hub id; a given path wins",
        (
            {"pretrained_model_name_or_path": None, "model_flavour": "dreamshaper"},
            {"pretrained_model_name_or_path": "Lykon/dreamshaper-8"},
        ),
        ({"pretrained_model_name_or_path": None}, {"pretrained_model_name_or_path": "Lykon/dreamshaper-8"}),
        ({"model_flavour": "dreamshaper"}, {"pretrained_model_name_or_path": "{cwd}/model"}),
    ),
    "prediction_type": _row(
        f"{R}model.py:302 {H}models/common.py:4551",
        "the DDPM target; unset, the scheduler's own",
        ({"prediction_type": "v_prediction"}, {"prediction_type": "v_prediction"}),
        ({}, {"prediction_type": UNSET}),
    ),
    "tokenizer_max_length": _row(
        f"{H}models/sd3/model.py:853 {H}models/sd3/model.py:448 {H}models/flux/model.py:1134",
        "SD3's T5 length, 154 when unset and capped at 154; Flux and Wan force 512, as here",
        ({"model_family": "sd3", "tokenizer_max_length": 77}, {"t5_max_length": 77}),
        ({"model_family": "sd3"}, {"t5_max_length": 154}),
        ({"model_family": "sd3", "tokenizer_max_length": 300}, {"t5_max_length": 154}),
        ({"model_family": "flux", "tokenizer_max_length": 300}, {"t5_max_length": UNSET}),
    ),
    "revision": _row(
        f"{R}model.py:1198 {H}models/common.py:3077",
        "passed to from_pretrained, which ignores it for a local folder",
        ({"revision": "main"}, {"revision": "main"}),
    ),
    "pretrained_vae_model_name_or_path": _row(
        f"{H}configuration/cmd_args.py:1070 {H}models/common.py:2690 {H}models/common.py:2701 "
        f"{H}configuration/cmd_args.py:985 {R}model.py:1126 {H}configuration/loader.py:139",
        "vae_path is this key, else the model; load_vae reads its vae/ subfolder, else its root. Unset (null and '' "
        "are not passed to the parser) it is the registry's default madebyollin/sdxl-vae-fp16-fix, and a path naming "
        "sdxl is dropped for every family but sdxl (pixart_sigma, kolors): the model's own VAE",
        ({"pretrained_vae_model_name_or_path": "vae"}, {"pretrained_vae_model_name_or_path": "{cwd}/vae"}),
        (
            {"pretrained_vae_model_name_or_path": "stabilityai/sd-vae-ft-mse"},
            {"pretrained_vae_model_name_or_path": "stabilityai/sd-vae-ft-mse"},
        ),
        ({"pretrained_vae_model_name_or_path": "model"}, {"pretrained_vae_model_name_or_path": UNSET}),
        ({"pretrained_vae_model_name_or_path": None}, {"pretrained_vae_model_name_or_path": UNSET}),
        (
            {"pretrained_vae_model_name_or_path": "madebyollin/sdxl-vae-fp16-fix"},
            {"pretrained_vae_model_name_or_path": UNSET},
        ),
        (
            {"model_family": "sdxl", "pretrained_vae_model_name_or_path": "madebyollin/sdxl-vae-fp16-fix"},
            {"pretrained_vae_model_name_or_path": "madebyollin/sdxl-vae-fp16-fix"},
        ),
        (
            {"model_family": "sdxl", "pretrained_vae_model_name_or_path": None},
            {"pretrained_vae_model_name_or_path": "madebyollin/sdxl-vae-fp16-fix"},
        ),
        ({"model_family": "sdxl"}, {"pretrained_vae_model_name_or_path": "madebyollin/sdxl-vae-fp16-fix"}),
        ({"model_family": "sd1x"}, {"pretrained_vae_model_name_or_path": UNSET}),
        also="tests/test_separate_vae.py::test_a_pipeline_folder_gives_its_vae_subfolder_before_its_root",
    ),
    "controlnet_model_name_or_path": _row(
        f"{H}models/sdxl/model.py:242 {H}models/sdxl/model.py:244 {H}models/flux/model.py:281 "
        f"{H}models/flux/model.py:283",
        "with controlnet, the ControlNet is ControlNetModel / FluxControlNetModel.from_pretrained(this path): a "
        "folder from the working directory or a hub id; unset, one made from the model",
        (
            {"model_family": "sdxl", "controlnet": True, "controlnet_model_name_or_path": "cn"},
            {"controlnet": True, "controlnet_model_name_or_path": "{cwd}/cn"},
        ),
        (
            {"model_family": "sdxl", "controlnet": True, "controlnet_model_name_or_path": "org/controlnet"},
            {"controlnet_model_name_or_path": "org/controlnet"},
        ),
        ({"model_family": "sdxl", "controlnet": True}, {"controlnet_model_name_or_path": UNSET}),
        family="sdxl",
        also="tests/test_controlnet.py::test_the_simpletuner_controlnet_example_trains",
    ),
    "aspect_bucket_alignment": _row(
        f"{H}models/sdxl/model.py:648 {H}models/wan/model.py:1529 {H}multiaspect/image.py:93",
        "each family forces its own alignment (SDXL 64, Wan 32) whatever the config says",
        ({"model_family": "sdxl", "aspect_bucket_alignment": 16}, {"aspect_bucket_alignment": 64}),
        ({"model_family": "wan", "aspect_bucket_alignment": 64}, {"aspect_bucket_alignment": 32}),
    ),
    "num_train_epochs": _row(
        f"{R}training.py:20 {H}training/trainer.py:3850 {H}training/trainer.py:3859",
        "epochs to train; 0 means max_train_steps decides",
        ({"num_train_epochs": "3", "max_train_steps": 0}, {"num_train_epochs": 3, "max_train_steps": UNSET}),
        ({"num_train_epochs": 0, "max_train_steps": 7}, {"num_train_epochs": UNSET, "max_train_steps": 7}),
    ),
    "max_train_steps": _row(
        f"{R}training.py:42 {H}training/trainer.py:3850",
        "optimizer steps to train; 0 means num_train_epochs decides",
        ({"max_train_steps": "7"}, {"max_train_steps": 7}),
        ({"max_train_steps": 0, "num_train_epochs": 2}, {"max_train_steps": UNSET, "num_train_epochs": 2}),
    ),
    "train_batch_size": _row(
        f"{R}training.py:61 {H}data_backend/factory.py:3560",
        "samples per batch on each process",
        ({"train_batch_size": "3"}, {"train_batch_size": 3}),
        ({}, {"train_batch_size": 4}),
    ),
    "gradient_accumulation_steps": _row(
        f"{R}training.py:161 {H}training/trainer.py:1027",
        "batches per optimizer step (accelerate's accumulation)",
        ({"gradient_accumulation_steps": 2}, {"gradient_accumulation_steps": 2}),
    ),
    "learning_rate": _row(
        f"{R}training.py:83 {H}training/trainer.py:4004",
        "the optimizer's lr (strings read as numbers by its parser)",
        ({"learning_rate": "1e-4"}, {"learning_rate": 1e-4}),
        ({}, {"learning_rate": 4e-7}),
    ),
    "grad_clip_method": _row(
        f"{R}optimizer.py:265 {H}training/trainer.py:7201 {H}training/trainer.py:7209",
        "`norm` clips the total L2 norm, `value` each element, to max_grad_norm",
        ({"grad_clip_method": "norm"}, {"grad_clip_method": "norm"}),
        ({}, {"grad_clip_method": "value"}),
    ),
    "flow_sigmoid_scale": _row(
        f"{R}advanced.py:399 {H}models/common.py:5072",
        "flow models draw sigma = sigmoid(scale * N(0, 1)), then shift",
        ({"flow_sigmoid_scale": "1.5"}, {"timestep_sampling": "logit_normal", "logit_mean": 0.0, "logit_std": 1.5}),
        ({}, {"timestep_sampling": "logit_normal", "logit_std": 1.0}),
        family="flux",
        also="tests/test_dialect_same_rows.py::test_flow_sigma_draw_is_simpletuners_sigmoid",
    ),
    "flow_use_uniform_schedule": _row(
        f"{R}advanced.py:417 {H}models/common.py:5074",
        "flow models draw sigma uniformly in [0, 1), then shift",
        ({"flow_use_uniform_schedule": "true"}, {"timestep_sampling": "uniform"}),
        family="flux",
    ),
    "disable_tf32": _row(
        f"{R}advanced.py:796 {H}configuration/cmd_args.py:1105 {H}configuration/cmd_args.py:114",
        "true keeps fp32 matmuls exact; false (default) turns TF32 on",
        ({"disable_tf32": True}, {"enable_tf32": False}),
        # the string "false" is skipped by its config reader (cli_utils.py:223-226): the default, TF32 on, stays
        ({"disable_tf32": "false"}, {"enable_tf32": UNSET}),
    ),
    "lora_type": _row(
        f"{R}lora.py:63 {H}models/common.py:991 {H}configuration/cmd_args.py:1116",
        "`standard` is a peft LoRA; `lycoris` a LyCORIS network from lycoris_config",
        ({"lora_type": "standard"}, {"lora_type": "standard"}),
    ),
    "lora_rank": _row(
        f"{R}lora.py:18 {H}models/common.py:1089",
        "the LoRA's r",
        ({"lora_rank": "8"}, {"lora_rank": 8}),
    ),
    "lora_alpha": _row(
        f"{R}lora.py:41 {H}models/common.py:1090",
        "the LoRA's alpha; unset, alpha = rank",
        ({"lora_alpha": 4}, {"lora_alpha": 4}),
        ({}, {"lora_alpha": UNSET}),
    ),
    "lora_dropout": _row(
        f"{R}lora.py:130 {H}models/common.py:1097",
        "dropout on the LoRA path (SimpleTuner's default 0.1)",
        ({"lora_dropout": "0.05"}, {"lora_dropout": 0.05}),
        ({}, {"lora_dropout": 0.1}),
    ),
    "flux_lora_target": _row(
        f"{H}models/field_registry/flux.py:63 {H}models/flux/model.py:1249 {H}models/flux/model.py:1283",
        "Flux LoRA layer sets by name; `all` by default",
        ({}, {"lora_target_modules": "flux:all"}),
        ({"flux_lora_target": "all+ffs"}, {"lora_target_modules": "flux:all+ffs"}),
        ({"flux_lora_target": "context"}, {"lora_target_modules": "flux:context"}),
        ({"flux_lora_target": "context+ffs"}, {"lora_target_modules": "flux:context+ffs"}),
        ({"flux_lora_target": "all+ffs+embedder"}, {"lora_target_modules": "flux:all+ffs+embedder"}),
        family="flux",
    ),
    "use_dora": _row(
        f"{R}lora.py:451 {H}models/common.py:1102",
        "peft's use_dora",
        ({"use_dora": True}, {"lora_use_dora": True}),
    ),
    "loss_type": _row(
        f"{R}loss.py:20 {H}models/common.py:6150",
        "l2, pseudo-Huber 2c(sqrt(d^2 + c^2) - c) or smooth_l1 2(sqrt(d^2 + c^2) - c)",
        ({"loss_type": "huber"}, {"loss_type": "huber"}),
        ({"loss_type": "smooth_l1"}, {"loss_type": "smooth_l1"}),
        also="tests/test_dialect_same_rows.py::test_huber_threshold_is_simpletuners",
    ),
    "huber_schedule": _row(
        f"{R}loss.py:42 {H}models/common.py:6168",
        "how the Huber threshold follows the noise level (default snr)",
        ({"huber_schedule": "exponential"}, {"huber_schedule": "exponential"}),
        also="tests/test_dialect_same_rows.py::test_huber_threshold_is_simpletuners",
    ),
    "huber_c": _row(
        f"{R}loss.py:65 {H}models/common.py:6185",
        "the Huber threshold, its floor under the schedules",
        ({"huber_c": "0.5"}, {"huber_c": 0.5}),
        also="tests/test_dialect_same_rows.py::test_huber_threshold_is_simpletuners",
    ),
    "offset_noise": _row(
        f"{R}logging_fields.py:517 {H}models/common.py:5941",
        "the switch: without it no noise offset is added; flow models never get one",
        ({"offset_noise": False, "noise_offset": 0.05}, {"noise_offset": UNSET}),
        ({"offset_noise": "true"}, {"noise_offset": 0.1, "noise_offset_probability": 0.25}),
    ),
    "noise_offset": _row(
        f"{R}advanced.py:834 {H}models/common.py:5942",
        "noise += offset * randn(B, C, 1, 1), with offset_noise on",
        ({"offset_noise": True, "noise_offset": "0.05"}, {"noise_offset": 0.05}),
        ({"model_family": "flux", "offset_noise": True, "noise_offset": 0.05}, {"noise_offset": UNSET}),
    ),
    "noise_offset_probability": _row(
        f"{R}advanced.py:855 {H}models/common.py:5942",
        "the chance a batch gets the offset",
        ({"offset_noise": True, "noise_offset_probability": "0.5"}, {"noise_offset_probability": 0.5}),
    ),
    "ema_decay": _row(
        f"{R}training.py:922 {H}training/trainer.py:4361 {H}training/ema.py:322",
        "the EMA's decay cap; the decay at step t is min((1 + s) / (10 + s), decay), s = t - 1",
        ({"ema_decay": "0.9"}, {"ema_decay": 0.9}),
        also="tests/test_dialect_same_rows.py::test_ema_decay_and_interval_are_simpletuners",
    ),
    "ema_update_interval": _row(
        f"{R}training.py:882 {H}training/ema.py:29",
        "the EMA updates after steps that are multiples of it",
        ({"ema_update_interval": "3"}, {"ema_update_interval": 3}),
        also="tests/test_dialect_same_rows.py::test_ema_decay_and_interval_are_simpletuners",
    ),
    "ema_warmup_steps": _row(
        f"{R}training.py:944 {H}training/ema.py:333",
        "N > 0: decay 0 before step N, then ema_decay unramped",
        ({"ema_warmup_steps": 50}, {"ema_warmup_steps": 50}),
        also="tests/test_dialect_same_rows.py::test_ema_decay_and_interval_are_simpletuners",
    ),
    "ema_validation": _row(
        f"{R}logging_fields.py:453 {H}training/validation.py:4516",
        "which weights validation renders: none, ema_only, comparison (default)",
        ({"ema_validation": "ema_only"}, {"ema_validation": "ema_only"}),
    ),
    "ema_device": _row(
        f"{R}training.py:839 {H}training/trainer.py:4383",
        "where the EMA lives: cpu (default) or accelerator",
        ({"ema_device": "accelerator"}, {"ema_device": "accelerator"}),
    ),
    "ema_cpu_only": _row(
        f"{R}training.py:862 {H}configuration/cmd_args.py:1076",
        "true keeps the EMA on the CPU (ema_device cpu)",
        ({"use_ema": True, "ema_cpu_only": True}, {"ema_device": "cpu"}),
    ),
    "output_dir": _row(
        f"{R}model.py:141 {H}configuration/cmd_args.py:1089",
        "where the run writes, from the working directory",
        ({"output_dir": "output/models"}, {"output_dir": "{cwd}/output/models"}),
        ({}, {"output_dir": "{cwd}/simpletuner-results"}),
    ),
    "validation_prompt": _row(
        f"{R}validation.py:152 {H}training/validation.py:4736",
        "the prompt validation renders",
        ({"validation_prompt": "a cat"}, {"validation_prompt": "a cat"}),
    ),
    "validation_guidance": _row(
        f"{R}validation.py:410 {H}training/validation.py:4722",
        "the pipeline's guidance_scale (default 7.5)",
        ({"validation_guidance": "4"}, {"validation_guidance_scale": 4}),
        ({}, {"validation_guidance_scale": 7.5}),
    ),
    "validation_num_inference_steps": _row(
        f"{R}validation.py:431 {H}training/validation.py:4721",
        "the pipeline's num_inference_steps (default 30)",
        ({"validation_num_inference_steps": "12"}, {"validation_num_inference_steps": 12}),
        ({}, {"validation_num_inference_steps": 30}),
    ),
    "num_validation_images": _row(
        f"{R}validation.py:189 {H}training/validation.py:4738",
        "num_images_per_prompt (default 1, ours too)",
        ({"num_validation_images": 2}, {"num_validation_images": 2}),
    ),
    "validation_negative_prompt": _row(
        f"{R}validation.py:549 {H}training/validation.py:4737",
        "the negative prompt (default 'blurry, cropped, ugly')",
        ({"validation_prompt": "x", "validation_negative_prompt": "bad"}, {"validation_negative_prompt": "bad"}),
        ({"validation_prompt": "x"}, {"validation_negative_prompt": "blurry, cropped, ugly"}),
    ),
    "validation_num_video_frames": _row(
        f"{R}validation.py:893",
        "frames per validation video; unset, the Wan pipeline's 81",
        ({"validation_prompt": "x", "validation_num_video_frames": 9}, {"validation_num_video_frames": 9}),
        ({"validation_prompt": "x"}, {"validation_num_video_frames": 81}),
        family="wan",
    ),
    "data_backend_config": _row(
        f"{R}data.py:66 {H}data_backend/factory.py:1843",
        "the dataset list, opened from the working directory",
        ({}, {"datasets.0.instance_data_dir": "{cwd}/data"}),
    ),
    "resolution": _row(
        f"{R}data.py:20 {H}data_backend/config/base.py:123 {H}data_backend/factory.py:3566",
        "the training size, and each dataset's when it sets none",
        ({"resolution": 512}, {"resolution": 512}),
        ({}, {"resolution": 1024}),
    ),
    "cache_dir": _row(
        f"{R}advanced.py:1330 {H}data_backend/factory.py:1476",
        "the root folder of caches, from the working directory",
        ({"cache_dir": "mycache"}, {"cache_config.cache_dir": "{cwd}/mycache"}),
    ),
    "cache_dir_text": _row(
        f"{R}advanced.py:1347 {H}data_backend/factory.py:2457",
        "the text-embedding cache folder",
        ({"cache_dir_text": "ct"}, {"cache_config.text_cache_dir": "{cwd}/ct"}),
    ),
    "vae_batch_size": _row(
        f"{R}data.py:498 {H}caching/vae.py:182",
        "images per VAE encode call (default 4)",
        ({"vae_batch_size": "2"}, {"vae_batch_size": 2}),
        ({}, {"vae_batch_size": 4}),
    ),
    "report_to": _row(
        f"{R}logging_fields.py:18 {H}training/trainer.py:1029",
        "the tracker accelerate logs to",
        ({"report_to": "tensorboard"}, {"report_to": "tensorboard"}),
        ({"report_to": "none"}, {"report_to": "none"}),
    ),
    "tracker_project_name": _row(
        f"{R}logging_fields.py:224 {H}training/trainer.py:502",
        "the tracker's project",
        ({"tracker_project_name": "p"}, {"tracker_project_name": "p"}),
    ),
    # --- Hub uploads (behaviour: tests/test_dialect_hub_upload.py) ---
    "push_to_hub": _row(
        f"{R}publishing.py:26 {H}publishing/huggingface.py:62 {H}publishing/huggingface.py:236 "
        f"{H}training/trainer.py:7772",
        "uploads the final weights and model card to the repo (default off); without push_to_hub_background "
        "(default false) the training waits for its checkpoint uploads",
        ({"push_to_hub": "true"}, {"push_to_hub": True, "push_to_hub_background": False}),
        ({"push_to_hub": True, "push_to_hub_background": True}, {"push_to_hub_background": True}),
        ({"push_to_hub": False}, {"push_to_hub": False, "push_to_hub_background": UNSET}),
        ({}, {"push_to_hub": UNSET, "push_to_hub_background": UNSET}),
        also="tests/test_dialect_hub_upload.py::test_an_uploading_config_validates_with_its_values",
    ),
    "push_checkpoints_to_hub": _row(
        f"{R}publishing.py:98 {H}training/trainer.py:7423 {H}training/trainer.py:7572 {H}publishing/huggingface.py:236",
        "each checkpoint is uploaded too; without push_to_hub the upload returns before any request",
        ({"push_to_hub": True, "push_checkpoints_to_hub": "true"}, {"push_checkpoints_to_hub": True}),
        ({"push_checkpoints_to_hub": True}, {"push_checkpoints_to_hub": UNSET, "push_to_hub": UNSET}),
        also="tests/test_dialect_hub_upload.py::test_checkpoint_uploads_without_push_to_hub_are_ignored_not_refused",
    ),
    "push_to_hub_background": _row(
        f"{R}publishing.py:115 {H}training/trainer.py:2214 {H}training/trainer.py:2299 "
        f"{H}configuration/cli_utils.py:191",
        "uploads run in a worker thread, only with push_to_hub on the main process; default false (null: the "
        "default): inline",
        ({"push_to_hub": True, "push_to_hub_background": "true"}, {"push_to_hub_background": True}),
        ({"push_to_hub": True, "push_to_hub_background": False}, {"push_to_hub_background": False}),
        ({"push_to_hub": True}, {"push_to_hub_background": False}),
        ({"push_to_hub": True, "push_to_hub_background": None}, {"push_to_hub_background": False}),
    ),
    "hub_model_id": _row(
        f"{R}publishing.py:133 {H}publishing/huggingface.py:30 {H}publishing/huggingface.py:40",
        "the repo; a huggingface.co URL is read as its id; unset (null, empty): tracker_project_name",
        ({"push_to_hub": True, "hub_model_id": "me/lora"}, {"hub_model_id": "me/lora"}),
        ({"push_to_hub": True, "hub_model_id": "https://huggingface.co/me/lora"}, {"hub_model_id": "me/lora"}),
        ({"push_to_hub": True, "hub_model_id": ""}, {"hub_model_id": UNSET}),
        ({"push_to_hub": True, "hub_model_id": None}, {"hub_model_id": UNSET}),
        also="tests/test_dialect_hub_upload.py::test_unset_hub_model_id_uploads_to_the_tracker_project",
    ),
    "model_card_private": _row(
        f"{R}publishing.py:151 {H}publishing/huggingface.py:62 {H}configuration/cli_utils.py:225",
        'create_repo(private=...) (default true); the string "false" is skipped by its reader: private',
        ({"model_card_private": False}, {"model_card_private": False}),
        ({"model_card_private": "true"}, {"model_card_private": True}),
        ({"model_card_private": "false"}, {"model_card_private": UNSET}),
    ),
    "model_card_note": _row(
        f"{R}publishing.py:185 {H}publishing/metadata.py:428",
        "a note near the top of the model card; empty adds none",
        ({"model_card_note": "trained on my cat"}, {"model_card_note": "trained on my cat"}),
        ({"model_card_note": ""}, {"model_card_note": UNSET}),
    ),
    "model_card_safe_for_work": _row(
        f"{R}publishing.py:168 {H}publishing/metadata.py:787",
        "the card's tag: safe-for-work when true, not-for-all-audiences otherwise (default false)",
        ({"model_card_safe_for_work": "true"}, {"model_card_safe_for_work": True}),
        ({"model_card_safe_for_work": False}, {"model_card_safe_for_work": False}),
    ),
    # --- top-level keys that are each dataset's default
    "resolution_type": _row(
        f"{R}data.py:42 {H}data_backend/config/base.py:126 {H}data_backend/factory.py:2967",
        "each dataset's unit unless it sets one (default pixel_area)",
        ({"resolution_type": "pixel"}, {"datasets.0.resolution_type": "pixel"}),
        ({}, {"datasets.0.resolution_type": "pixel_area"}),
    ),
    "minimum_image_size": _row(
        f"{R}advanced.py:2295 {H}data_backend/config/image.py:129 {H}metadata/backends/base.py:1259",
        "each dataset's minimum unless it sets one; 0 means none",
        ({"resolution_type": "pixel", "minimum_image_size": 256}, {"datasets.0.minimum_image_size": 256}),
        ({"minimum_image_size": 0}, {"datasets.0.minimum_image_size": UNSET}),
    ),
    "caption_strategy": _row(
        f"{H}data_backend/factory.py:626 {H}prompts.py:389",
        "each dataset's caption strategy unless it sets one (default filename: the stem, `_` as a space)",
        ({"caption_strategy": "textfile"}, {"datasets.0.caption_strategy": "textfile"}),
        ({}, {"datasets.0.caption_strategy": "filename"}),
        also="tests/test_data_backend_metadata.py::test_caption_from_filename_is_simpletuners",
    ),
    "instance_prompt": _row(
        f"{R}data.py:132 {H}data_backend/factory.py:3506",
        "each dataset's instance prompt unless it sets one",
        ({"instance_prompt": "sks"}, {"datasets.0.instance_prompt": "sks"}),
    ),
    "prepend_instance_prompt": _row(
        f"{R}advanced.py:1131 {H}data_backend/factory.py:3505 {H}prompts.py:393",
        "each dataset's switch: caption = instance_prompt + ' ' + caption",
        ({"instance_prompt": "sks", "prepend_instance_prompt": True}, {"datasets.0.prepend_instance_prompt": True}),
        also="tests/test_captions_dialect.py::test_prepend_puts_the_instance_prompt_and_a_space_first",
    ),
    "cache_dir_vae": _row(
        f"{R}advanced.py:1420 {H}data_backend/factory.py:1216",
        "each dataset's VAE cache folder, {model_family} filled in",
        ({"cache_dir_vae": "cache/vae/{model_family}"}, {"datasets.0.cache_dir_vae": "{cwd}/cache/vae/sd1x"}),
    ),
    # --- rows whose meaning comes from more than a rename (tests/test_dialect_meaning.py) ---
    "lr_scheduler": _row(
        f"{H}training/custom_schedule.py:574 {H}training/custom_schedule.py:586 {H}configuration/cli_utils.py:64",
        "its own cosine class, diffusers' polynomial with its lr_end / lr_power, constant + warm-up ramps",
        ({"lr_scheduler": "cosine", "lr_warmup_steps": 100}, {"lr_scheduler": "simpletuner_cosine", "lr_end": 4e-7}),
        ({"lr_scheduler": "constant", "lr_warmup_steps": 5}, {"lr_scheduler": "constant_with_warmup"}),
        (
            {"lr_scheduler": "polynomial", "learning_rate": 1e-4},
            {"lr_scheduler": "polynomial", "lr_end": 4e-7, "lr_power": 0.8},
        ),
        also=f"{MEANING}test_cosine_is_simpletuners_own_class "
        f"{MEANING}test_polynomial_takes_simpletuners_end_and_power "
        f"{MEANING}test_constant_with_warmup_ramps_as_simpletuner_rewrites_it",
    ),
    "lr_warmup_steps": _row(
        f"{H}training/custom_schedule.py:578 {H}training/custom_schedule.py:598",
        "the linear warm-up of diffusers' schedules, and the half-period of its cosine",
        ({"lr_scheduler": "cosine", "lr_warmup_steps": "50"}, {"lr_warmup_steps": 50}),
        also=f"{MEANING}test_cosine_without_warmup_has_simpletuners_fallback_period",
    ),
    "lr_end": _row(
        f"{R}advanced.py:921 {H}training/custom_schedule.py:583 {H}training/custom_schedule.py:592",
        "the floor of its cosine and polynomial schedules (4e-7 unless set)",
        ({"lr_scheduler": "cosine", "lr_end": "1e-6"}, {"lr_end": 1e-6}),
        ({"lr_scheduler": "constant", "lr_end": 4e-7}, {"lr_end": UNSET}),
        also=f"{MEANING}test_cosine_floor_is_the_configs_lr_end",
    ),
    "lr_power": _row(
        f"{R}training.py:787 {H}training/custom_schedule.py:593",
        "the polynomial schedule's exponent (0.8 unless set)",
        ({"lr_scheduler": "polynomial", "lr_power": 2, "learning_rate": 1e-4}, {"lr_power": 2}),
        also=f"{MEANING}test_polynomial_takes_simpletuners_end_and_power",
    ),
    "optimizer": _row(
        f"{H}training/optimizer_param.py:191 {H}training/optimizer_param.py:315 {H}training/optimizer_param.py:913 "
        f"{H}training/optimizer_param.py:87 {H}training/optimizer_param.py:154 {H}training/optimizer_param.py:290 "
        f"{H}training/optimizer_param.py:327 {H}training/optimizer_param.py:368 {H}training/optimizer_param.py:589 "
        f"{H}training/optimizer_param.py:625 {H}training/optimizer_param.py:878",
        "the optimizer class (optimi's, bitsandbytes', torch's), built from its own default settings; "
        "adafactor / adamw8bit stop the run",
        ({"optimizer": "optimi-adamw"}, {"optimizer": "optimi-adamw", "adam_beta2": 0.99, "adam_epsilon": 1e-6}),
        ({"optimizer": "optimi-sgd"}, {"optimizer": "optimi-sgd", "optimizer_config.momentum": 0.0}),
        ({"optimizer": "optimi-lion"}, {"optimizer": "optimi-lion", "adam_beta2": 0.99, "weight_decay": 0.0}),
        (
            {"optimizer": "optimi-adan"},
            {"optimizer": "optimi-adan", "adam_beta1": 0.98, "adam_beta2": 0.92, "optimizer_config.beta3": 0.999},
        ),
        ({"optimizer": "optimi-radam"}, {"optimizer": "optimi-radam", "optimizer_config.decouple_wd": True}),
        ({"optimizer": "bnb-adamw8bit"}, {"optimizer": "bnb-adamw8bit", "adam_epsilon": 1e-6, "weight_decay": UNSET}),
        ({"optimizer": "bnb-lion8bit"}, {"optimizer": "bnb-lion8bit", "adam_beta2": 0.99, "weight_decay": 0.0}),
        ({"optimizer": "torch-adafactor"}, {"optimizer": "torch-adafactor", "weight_decay": 0.0}),
        ({"optimizer": "torch-adamw"}, {"optimizer": "adamw", "adam_beta2": UNSET, "weight_decay": UNSET}),
        also=f"{MEANING}test_each_optimizer_gets_simpletuners_own_defaults "
        f"{MEANING}test_optimi_sgd_builds_sgd_without_momentum "
        f"{MORE}test_the_named_optimizers_are_the_library_classes_with_simpletuners_defaults "
        f"{MORE}test_simpletuners_removed_optimizers_stop_with_its_reason",
    ),
    "optimizer_config": _row(
        f"{H}training/optimizer_param.py:885 {H}training/optimizer_param.py:913",
        "key=value settings over the optimizer's defaults",
        ({"optimizer_config": "eps=1e-8,weight_decay=0.1"}, {"adam_epsilon": 1e-8, "weight_decay": 0.1}),
        also=f"{MEANING}test_optimizer_config_and_betas_take_simpletuners_precedence",
    ),
    "optimizer_beta1": _row(
        f"{H}training/optimizer_param.py:905 {H}configuration/cmd_args.py:1079",
        "with optimizer_beta2, the betas over every other source (one alone stops the run)",
        ({"optimizer_beta1": 0.8, "optimizer_beta2": 0.95}, {"adam_beta1": 0.8, "adam_beta2": 0.95}),
        also=f"{MEANING}test_optimizer_config_and_betas_take_simpletuners_precedence",
    ),
    "optimizer_beta2": _row(
        f"{H}training/optimizer_param.py:905 {H}configuration/cmd_args.py:1079",
        "with optimizer_beta1, the betas over every other source",
        ({"optimizer_beta1": 0.85, "optimizer_beta2": 0.9}, {"adam_beta1": 0.85, "adam_beta2": 0.9}),
    ),
    "seed": _row(
        f"{R}model.py:223 {H}training/trainer.py:2555",
        "seeds the run when set (unset: 42 here, said at start)",
        ({"seed": "7"}, {"seed": 7}),
        ({}, {"seed": UNSET}),
        also=f"{MEANING}test_validation_every_100_steps_and_the_seed_said",
    ),
    "validation_step_interval": _row(
        f"{R}validation.py:18",
        "validation every N steps, 100 when unset",
        ({"validation_prompt": "a cat", "validation_step_interval": 7}, {"validation_steps": 7}),
        ({"validation_prompt": "a cat"}, {"validation_steps": 100}),
    ),
    "validation_steps": _row(
        f"{R}validation.py:21",
        "the alias of validation_step_interval",
        ({"validation_prompt": "a cat", "validation_steps": 9}, {"validation_steps": 9}),
    ),
    "flow_schedule_shift": _row(
        f"{H}training/custom_schedule.py:514 {H}models/wan/model.py:988",
        "the static sigma shift of flow families (forced to 5.0 for Wan 2.2 I2V A14B)",
        ({"flow_schedule_shift": 2.0}, {"flow_shift": 2.0}),
        family="flux",
        also=f"{MEANING}test_wan22_i2v_a14b_gets_the_flavours_shift_steps_and_guidance",
    ),
    **{
        f"flux_guidance_{k}": _row(
            f"{H}models/field_registry/flux.py:92 {H}models/flux/model.py:683 {H}models/flux/model.py:697",
            "Flux's embedded guidance: constant, or a uniform draw per sample",
            ({f"flux_guidance_{k}": v}, {f"flux_guidance_{k}": v}),
            family="flux",
            also=f"{GUIDANCE}test_defaults_are_simpletuners "
            f"{GUIDANCE}test_random_range_draws_per_sample_from_the_runs_generator",
        )
        for k, v in (("mode", "random-range"), ("value", 3.5), ("min", 1.0), ("max", 5.0))
    },
    "caption_dropout_probability": _row(
        f"{R}advanced.py:1189 {H}training/collate.py:614",
        "each sample's caption is replaced by an empty one with this chance (SDXL: approximated, said)",
        ({"caption_dropout_probability": "0.05"}, {"caption_dropout_probability": 0.05}),
        ({}, {"caption_dropout_probability": 0.1}),
    ),
    "masked_loss_probability": _row(
        f"{R}loss.py:102 {R}loss.py:108 {H}models/common.py:6409 {H}models/common.py:6418",
        "the chance a batch of a segmentation dataset has its loss weighted by its mask (default 1.0); a mask "
        "dataset's mask weights every batch",
        ({"masked_loss_probability": "0.25"}, {"masked_loss_probability": 0.25}),
        ({}, {"masked_loss_probability": UNSET}),  # the native default is 1.0
        also="tests/test_masked_loss.py::test_masked_loss_probability_draws_segmentation_batches_only",
    ),
    "checkpoint_step_interval": _row(
        f"{H}training/trainer.py:5591 {H}training/trainer.py:5593",
        "a checkpoint every N steps; 0 falls back to checkpointing_steps, else none",
        ({"checkpoint_step_interval": 20}, {"checkpointing_steps": 20}),
        ({"checkpoint_step_interval": 0}, {"checkpointing_steps": UNSET}),
    ),
    "checkpointing_steps": _row(
        f"{H}training/trainer.py:5594",
        "the older name of checkpoint_step_interval",
        ({"checkpointing_steps": 30}, {"checkpointing_steps": 30}),
    ),
    "checkpoints_total_limit": _row(
        f"{H}training/trainer.py:5697",
        "the checkpoints kept; 0 keeps all",
        ({"checkpoints_total_limit": 2}, {"checkpoints_total_limit": 2}),
        ({"checkpoints_total_limit": 0}, {"checkpoints_total_limit": UNSET}),
    ),
    "gradient_checkpointing": _row(
        f"{H}configuration/cli_utils.py:225",
        'recompute activations in backward (default on); the string "false" is skipped by its reader',
        ({"gradient_checkpointing": False}, {"gradient_checkpointing": False}),
        ({"gradient_checkpointing": "false"}, {"gradient_checkpointing": True}),
    ),
    "tread_config": _row(
        f"{H}configuration/cmd_args.py:761 {H}training/tread.py:82 {H}training/tread.py:93 {H}training/tread.py:153 "
        f"{H}models/flux/transformer.py:1105 {H}models/flux/transformer.py:1121 {H}models/wan/transformer.py:1098",
        "TREAD: from block start_layer_idx to end_layer_idx each sample keeps S - round(S * selection_ratio) random "
        "tokens (their rotary rows with them), the others rejoin unchanged after it; negative indices count from the "
        "end of all blocks (Flux: double then single); only while training with gradients; a string is read as a "
        "Python literal",
        (
            {"tread_config": {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}},
            {"tread_config": {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}},
        ),
        (
            {"tread_config": "{'routes': [{'selection_ratio': 0.1, 'start_layer_idx': 2, 'end_layer_idx': 8}]}"},
            {"tread_config.routes.0.selection_ratio": 0.1, "tread_config.routes.0.end_layer_idx": 8},
        ),
        ({"tread_config": None}, {"tread_config": UNSET}),
        family="flux",
        also="tests/test_tread.py::test_budget_and_block_numbering_are_simpletuners "
        "tests/test_tread.py::test_ratio_zero_is_the_run_without_routing "
        "tests/test_tread.py::test_eval_and_no_grad_see_every_token",
    ),
    "lycoris_config": _row(
        f"{H}configuration/cmd_args.py:1116",
        "the LyCORIS settings file, read only with lora_type lycoris",
        ({"lycoris_config": "missing.json"}, {"lycoris": UNSET, "lora_rank": UNSET}),
    ),
    "max_grad_norm": _row(
        f"{H}training/trainer.py:7138 {H}training/trainer.py:7140",
        "clips gradients above it (0: off); never for prodigy or optimi-stableadamw",
        ({"max_grad_norm": "1.0"}, {"max_grad_norm": 1.0}),
        ({"max_grad_norm": 0}, {"max_grad_norm": None}),
        ({"optimizer": "prodigy", "max_grad_norm": 1.0}, {"max_grad_norm": None}),
        ({"optimizer": "optimi-stableadamw", "max_grad_norm": 1.0}, {"max_grad_norm": None}),
    ),
    "only_instance_prompt": _row(
        f"{H}data_backend/factory.py:3519",
        "every dataset's captions become its instance prompt, whatever the dataset says",
        ({"only_instance_prompt": True, "instance_prompt": "sks"}, {"datasets.0.caption_strategy": "instance_prompt"}),
    ),
    "peft_lora_target_modules": _row(
        f"{H}configuration/cmd_args.py:283",
        "the adapted modules: a list, a JSON list in a string, or a JSON file",
        ({"peft_lora_target_modules": ["to_q", "to_v"]}, {"lora_target_modules": ["to_q", "to_v"]}),
        ({"peft_lora_target_modules": '["to_k"]'}, {"lora_target_modules": ["to_k"]}),
    ),
    "rescale_betas_zero_snr": _row(
        f"{H}models/common.py:4548 {H}models/sd1x/model.py:395",
        "DDPM betas rescaled to zero terminal SNR (forced for sd2x; ignored for flow families)",
        ({"rescale_betas_zero_snr": True}, {"rescale_betas_zero_snr": True}),
        ({"model_family": "sd2x"}, {"rescale_betas_zero_snr": True}),
        also=f"{MEANING}test_sd2x_trains_with_zero_terminal_snr_as_simpletuner_forces",
    ),
    "resume_from_checkpoint": _row(
        f"{H}training/trainer.py:5022 {H}training/trainer.py:5049",
        "latest, or a checkpoint of that name inside output_dir",
        ({"resume_from_checkpoint": "latest"}, {"resume_from_checkpoint": "latest"}),
        (
            {"resume_from_checkpoint": "elsewhere/checkpoint-5", "output_dir": "out"},
            {"resume_from_checkpoint": "{cwd}/out/checkpoint-5"},
        ),
    ),
    "snr_gamma": _row(
        f"{H}models/common.py:6360",
        "Min-SNR weighting for DDPM families (flow families: ignored)",
        ({"snr_gamma": 5}, {"snr_gamma": 5, "loss_weighting": "min_snr"}),
        ({"snr_gamma": 5, "model_family": "flux"}, {"loss_weighting": UNSET}),
    ),
    "validation_seed": _row(
        f"{H}training/validation.py:2208",
        "the validation generator's seed; 0 means the run's seed",
        ({"validation_seed": 3}, {"validation_seed": 3}),
        ({"validation_seed": 0}, {"validation_seed": UNSET}),
    ),
}


def write_project(tmp_path: Path, top: dict, dataset: dict | None = None, family: str = "sd1x") -> dict:
    """SimpleTuner's working directory with a model folder, one image and a dataset list; the config."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "data").mkdir(exist_ok=True)
    Image.new("RGB", (96, 64), "red").save(tmp_path / "data" / "a.png")
    entry = {"id": "d", "type": "local", "instance_data_dir": "data", **(dataset or {})}
    (tmp_path / "multidatabackend.json").write_text(json.dumps([entry]))
    return {**BASE, "model_family": family, **top}


def translated(tmp_path: Path, top: dict, dataset: dict | None = None, family: str = "sd1x") -> dict:
    """The native config SimpleTuner's ``top`` (and its dataset entry) translates to; it must load."""
    native, _ = dialect.translate(write_project(tmp_path, top, dataset, family), None, tmp_path)
    validate_config(native, check_files=False)
    return native


def lookup(native: dict, dotted: str) -> Any:
    node: Any = native
    for part in dotted.split("."):
        if isinstance(node, list) and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return UNSET
    return node


def expected(value: Any, cwd: Path) -> Any:
    if isinstance(value, str) and value.startswith("flux:"):
        return sorted(FLUX_TARGETS[value[5:]])
    if isinstance(value, str) and "{cwd}" in value:
        return value.replace("{cwd}", str(cwd))
    return value


def check_case(native: dict, expect: dict, cwd: Path) -> None:
    for key, value in expect.items():
        got = lookup(native, key)
        want = expected(value, cwd)
        if isinstance(value, str) and value.startswith("flux:"):
            got = sorted(got)
        assert got is want if want is UNSET else got == want, f"{key}: {got!r}, SimpleTuner's figure {want!r}"
        if isinstance(want, (int, float)) and not isinstance(want, bool):
            assert not isinstance(got, str), f"{key}: {got!r} is a string; SimpleTuner's parser reads a number"


#: SimpleTuner's Flux LoRA layer sets, as its flux/model.py:1249-1339 lists them (order aside).
FLUX_TARGETS = {
    "all": {"to_k", "to_q", "to_v", "to_qkv", "add_qkv_proj", "add_k_proj", "add_q_proj", "add_v_proj", "to_out.0"}
    | {"to_add_out"},
    "context": {"add_k_proj", "add_q_proj", "add_v_proj", "add_qkv_proj", "to_add_out"},
}
FLUX_TARGETS["context+ffs"] = FLUX_TARGETS["context"] | {"ff_context.net.0.proj", "ff_context.net.2"}
FLUX_TARGETS["all+ffs"] = (
    FLUX_TARGETS["all"]
    | {"ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj"}
    | {
        "ff_context.net.2",
        "proj_mlp",
        "proj_out",
    }
)
FLUX_TARGETS["all+ffs+embedder"] = FLUX_TARGETS["all+ffs"] | {"x_embedder"}


@pytest.mark.parametrize(
    "key,index", [(key, i) for key, row in TOP_ROWS.items() for i in range(len(row.cases))], ids=lambda v: str(v)
)
def test_top_level_row_translates_to_simpletuners_meaning(tmp_path, key, index):
    row = TOP_ROWS[key]
    given, expect = row.cases[index]
    check_case(translated(tmp_path, given, family=row.family), expect, tmp_path)


# --- behaviours checked against SimpleTuner's figures ------------------------------------------------------------


def test_ema_decay_and_interval_are_simpletuners():
    # SimpleTuner's EMAModel.get_decay (training/ema.py:322-349) run with decay 0.995, at steps 1, 2, 3, 10, 100,
    # 1000, 5000; then with warmup_steps 50 and decay 0.999 (ema.py:333-336) at steps 1, 49, 50, 51.
    assert [round(decay_at(t, 0.995), 6) for t in (1, 2, 3, 10, 100, 1000, 5000)] == [
        0.0,
        0.181818,
        0.25,
        0.526316,
        0.917431,
        0.99108,
        0.995,
    ]
    assert [decay_at(t, 0.999, 50) for t in (1, 49, 50, 51)] == [0.0, 0.0, 0.999, 0.999]
    # should_update_ema (ema.py:29-37) with ema_update_interval 3 over steps 1..9: 3, 6, 9.
    ema = EMA({"w": torch.nn.Parameter(torch.zeros(1))}, decay=0.9, update_interval=3)
    assert [t for t in range(1, 10) if ema.should_update(t)] == [3, 6, 9]


#: SimpleTuner's compute_scheduled_huber_c (models/common.py:6168-6212) with huber_c 0.1: DDPM (SD 1.5's
#: scaled_linear 0.00085-0.012 schedule) at timesteps 0, 500, 999; flow matching at timesteps 100, 500, 900
#: (sigma x 1000, common.py:5089).
HUBER_C = {
    "snr": ([0.949709, 0.231284, 0.103691], [0.156292, 0.325022, 0.606264]),
    "exponential": ([1.0, 0.316228, 0.100231], [0.794328, 0.316228, 0.125893]),
    "constant": ([0.1] * 3, [0.1] * 3),
}


@pytest.mark.parametrize("schedule", sorted(HUBER_C))
def test_huber_threshold_is_simpletuners(schedule):
    sd15 = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
    ddpm, flow = HUBER_C[schedule]
    got = torch.as_tensor(losses.ddpm_huber_c(torch.tensor([0, 500, 999]), sd15, schedule, 0.1)).expand(3)
    assert torch.allclose(got, torch.tensor(ddpm), atol=1e-6)
    got = torch.as_tensor(losses.flow_huber_c(torch.tensor([0.1, 0.5, 0.9]), schedule, 0.1)).expand(3)
    assert torch.allclose(got, torch.tensor(flow), atol=1e-6)
    # The loss itself: SimpleTuner's conditional_loss (common.py:6152-6163) at d = 0.3, c = 0.1:
    # huber 2 * 0.1 * (sqrt(0.09 + 0.01) - 0.1) = 0.043246; smooth_l1 2 * (0.316228 - 0.1) = 0.432456.
    pred, target = torch.full((1, 1), 0.3), torch.zeros(1, 1)
    assert torch.allclose(losses.per_sample_loss(pred, target, "huber", 0.1), torch.tensor([0.043246]), atol=1e-6)
    assert torch.allclose(losses.per_sample_loss(pred, target, "smooth_l1", 0.1), torch.tensor([0.432456]), atol=1e-6)


def test_flow_sigma_draw_is_simpletuners_sigmoid():
    # models/common.py:5072: sigmas = sigmoid(flow_sigmoid_scale * N(0, 1)); the same normal draws give the same
    # sigmas here (logit_normal, logit_mean 0, logit_std = the scale).
    z = torch.randn(8, generator=torch.Generator().manual_seed(3))
    u = noise.sample_u(8, torch.Generator().manual_seed(3), "logit_normal", 0.0, 1.5)
    assert torch.allclose(u, torch.sigmoid(1.5 * z))


# --- the table ------------------------------------------------------------------------------------------------------


def all_evidence() -> dict[tuple[str, str], Row]:
    from test_dialect_same_rows_datasets import DATASET_ROWS

    return {**{("top", k): r for k, r in TOP_ROWS.items()}, **{("dataset", k): r for k, r in DATASET_ROWS.items()}}


def test_every_same_row_has_evidence():
    same = {(e.section, e.key) for e in dialect.DIALECT if e.kind == "same"}
    evidence = all_evidence()
    missing = sorted(same - set(evidence) - LEAD_OWNED)
    assert not missing, "\n".join(
        f"{section} `{key}` is marked `same` without evidence: back it with figures from SimpleTuner's code "
        "(tests/test_dialect_same_rows*.py) or mark it approximated"
        for section, key in missing
    )
    stale = sorted(set(evidence) - same)
    assert not stale, f"evidence for rows that are not `same` (drop it, or mark the row same): {stale}"
    assert not set(evidence) & LEAD_OWNED


def test_evidence_cites_simpletuner_lines_and_existing_tests():
    for (section, key), row in all_evidence().items():
        assert row.where and row.does and row.cases, f"{section} {key}: evidence needs lines, a sentence, cases"
        for place in row.where:
            match = re.fullmatch(r"(simpletuner/[\w/.]+\.(?:py|json)):(\d+)", place)
            assert match, f"{section} {key}: {place!r} is not path:line"
            source = SIMPLETUNER_SOURCE / match[1]
            if SIMPLETUNER_SOURCE.is_dir():
                lines = source.read_text(encoding="utf-8").splitlines()
                assert int(match[2]) <= len(lines), f"{section} {key}: {place} is past the end of the file"
        for test in row.also:
            path, _, name = test.partition("::")
            assert re.search(rf"^def {re.escape(name)}\(", (TESTS.parent / path).read_text(), re.M), test
    assert SIMPLETUNER_COMMIT.startswith("bc8e6ab7")
