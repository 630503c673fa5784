"""Every `same` row of the ai-toolkit table, backed by figures taken from ai-toolkit's code (commit AIT_COMMIT).

Each row of :data:`ROWS` names the ai-toolkit lines that give the key its meaning, says in a sentence what
ai-toolkit does with it, and lists job fragments (dotted paths into the trainer process) with the native values
the translation must write. Where the meaning is a behaviour (a timestep draw, a bucket size, an optimizer), a
test below computes ai-toolkit's figure from the formula at the cited lines and holds ours to it (or, where the
two differ, the row is `approximated` and the figure that differs is in its warning).
:func:`test_every_same_row_has_evidence` keeps the table honest: a `same` row with no evidence here fails.
"""

from __future__ import annotations

import math
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from simpletuner.configuration import validate_config
from simpletuner.configuration.aitoolkit import translate as ait
from simpletuner.configuration.aitoolkit.facts import AIT_COMMIT, AIT_KEYS, OPTIMIZER_DIFFERENCES
from simpletuner.configuration.aitoolkit.table import AIT_DIALECT
from simpletuner.configuration.simpletuner.reading import DialectError
from simpletuner.data_backend.buckets import bucket_for
from simpletuner.models import noise

#: A bare mirror of ostris/ai-toolkit, when present: cited lines are checked to exist at AIT_COMMIT.
MIRROR = Path("/work/.mirror/ostris+ai-toolkit/repo")
UNSET = object()
CM = "toolkit/config_modules.py"
BASE = "jobs/process/BaseSDTrainProcess.py"
BTP = "jobs/process/BaseTrainProcess.py"
SDT = "extensions_built_in/sd_trainer/SDTrainer.py"
DM = "toolkit/dataloader_mixins.py"
OPT = "toolkit/optimizer.py"
SAMPLER = "toolkit/samplers/custom_flowmatch_sampler.py"
WAN22 = "extensions_built_in/diffusion_models/wan22/wan22_14b_model.py"
EXT = "extensions_built_in/sd_trainer/__init__.py"
#: One citation: ``path:line`` or ``path:first-last``, ``=`` the text those lines hold.
CITE = re.compile(r"([\w/.]+\.py):(\d+)(?:-(\d+))?=(.+?)(?= [\w/.]+\.py:\d|$)")


@dataclass(frozen=True)
class Cite:
    path: str
    first: int
    last: int
    shows: str  # text the cited lines hold: the code the row's claim rests on


@dataclass(frozen=True)
class Row:
    where: tuple[Cite, ...]
    does: str
    cases: tuple[tuple[dict, dict], ...]


def _row(where: str, does: str, *cases: tuple[dict, dict]) -> Row:
    """``where``: citations ``path:line=text`` or ``path:first-last=text``, separated by a space."""
    cites = tuple(Cite(m[1], int(m[2]), int(m[3] or m[2]), m[4]) for m in CITE.finditer(where))
    assert cites and " ".join(m[0] for m in CITE.finditer(where)) == where, f"unreadable citations: {where!r}"
    return Row(cites, does, cases)


def job(fragment: dict[str, Any]) -> dict:
    """A flux trainer job with one dataset, ``fragment``'s dotted paths set in its process (None: removed)."""
    process: dict[str, Any] = {
        "type": "sd_trainer",
        "training_folder": "out",
        "model": {"name_or_path": "model", "arch": "flux"},
        "network": {"type": "lora", "linear": 16, "linear_alpha": 16},
        "datasets": [{"folder_path": "data", "caption_ext": "txt", "resolution": 512}],
        "train": {"steps": 10, "lr": 1e-4, "optimizer": "adamw", "noise_scheduler": "flowmatch"},
        "sample": {"prompts": ["a cat"]},
    }
    for dotted, value in fragment.items():
        node = process
        *parents, last = dotted.split(".")
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return {"job": "extension", "config": {"name": "run", "process": [process]}}


def translated(tmp_path: Path, fragment: dict[str, Any]) -> dict:
    native, _ = ait.translate(job(fragment), None, tmp_path)
    validate_config(native, check_files=False)
    return native


def lookup(native: dict, dotted: str) -> Any:
    node: Any = native
    for part in dotted.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return UNSET
    return node


ROWS: dict[tuple[str, str], Row] = {
    ("job", "job"): _row(
        "toolkit/job.py:27-29=ExtensionJob jobs/ExtensionJob.py:21-22=process.run()",
        "`job: extension` runs each process of config.process, as the extension its `type` names",
        ({}, {"model_family": "flux"}),
    ),
    ("job", "config.name"): _row(
        "toolkit/config.py:43-47=config.name jobs/BaseJob.py:18=get_conf('name', required=True) "
        "jobs/process/BaseProcess.py:21=self.job.name "
        f"{BTP}:45=self.training_folder, self.name",
        "the run's folder is training_folder/name",
        ({}, {"output_dir": "{cwd}/out/run"}),
    ),
    ("job", "config.process"): _row(
        "jobs/BaseJob.py:53-64=self.config['process'] jobs/ExtensionJob.py:21-22=for process in self.process",
        "each entry of config.process is a process run in turn (one here)",
        ({}, {"datasets.0.id": "dataset0"}),
    ),
    ("process", "type"): _row(
        f"{EXT}:8=sd_trainer {EXT}:26=ui_trainer {EXT}:44=diffusion_trainer "
        "jobs/BaseJob.py:58-64=process_dict[process['type']]",
        "sd_trainer / ui_trainer / diffusion_trainer run ai-toolkit's trainer",
        ({"type": "ui_trainer"}, {"model_family": "flux"}),
    ),
    ("process", "training_folder"): _row(
        f"{BTP}:43-45=self.training_folder, self.name",
        "the folder the run's folder is made in, from the working directory",
        ({"training_folder": "runs"}, {"output_dir": "{cwd}/runs/run"}),
    ),
    ("process", "name"): _row(
        "jobs/process/BaseProcess.py:21=self.name = self.get_conf('name', self.job.name) "
        f"{BTP}:45=os.path.join(self.training_folder, self.name)",
        "the process's own name, where set, names the run's folder in place of the job's",
        ({"name": "stage1"}, {"output_dir": "{cwd}/out/stage1", "tracker_project_name": "run"}),
    ),
    ("network", "linear"): _row(
        f"{CM}:173=kwargs.get('linear', None) {CM}:177-182=self.linear: int = 4",
        "the LoRA rank; default 4",
        ({"network.linear": 8}, {"lora_rank": 8}),
        ({"network.linear": None}, {"lora_rank": 4}),
    ),
    ("network", "rank"): _row(
        f"{CM}:172-176=rank for backward compatibility",
        "the older name of linear; it wins where both are written",
        ({"network.linear": None, "network.rank": 8}, {"lora_rank": 8}),
        ({"network.linear": 16, "network.rank": 8}, {"lora_rank": 8}),
    ),
    ("network", "linear_alpha"): _row(
        f"{CM}:185=kwargs.get('linear_alpha', self.alpha)",
        "the LoRA alpha (scale alpha / rank); default `alpha`, 1.0",
        ({"network.linear_alpha": 4}, {"lora_alpha": 4.0}),
        ({"network.linear_alpha": None}, {"lora_alpha": 1.0}),
    ),
    ("network", "alpha"): _row(
        f"{CM}:184=kwargs.get('alpha', 1.0)",
        "alpha where linear_alpha is unset",
        ({"network.linear_alpha": None, "network.alpha": 8}, {"lora_alpha": 8.0}),
    ),
    ("network", "dropout"): _row(
        f"{CM}:187=kwargs.get('dropout', None)",
        "dropout on the LoRA path",
        ({"network.dropout": 0.1}, {"lora_dropout": 0.1}),
    ),
    ("save", "max_step_saves_to_keep"): _row(
        f"{CM}:27=kwargs.get('max_step_saves_to_keep', 5)",
        "step saves kept; default 5",
        ({}, {"checkpoints_total_limit": 5}),
        ({"save.max_step_saves_to_keep": 2}, {"checkpoints_total_limit": 2}),
    ),
    ("save", "save_format"): _row(
        f"{CM}:28-30=['safetensors', 'diffusers']",
        "safetensors: the adapter file",
        ({"save.save_format": "safetensors"}, {"lora_type": "standard"}),
    ),
    ("save", "push_to_hub"): _row(
        f'{CM}:31=kwargs.get("push_to_hub", False)',
        "upload at the end",
        ({"save.push_to_hub": True, "save.hf_repo_id": "me/run"}, {"push_to_hub": True, "model_card_private": False}),
    ),
    ("save", "hf_repo_id"): _row(
        f'{CM}:32=kwargs.get("hf_repo_id", None)',
        "the repo uploaded to",
        ({"save.push_to_hub": True, "save.hf_repo_id": "me/run"}, {"hub_model_id": "me/run"}),
    ),
    ("save", "hf_private"): _row(
        f'{CM}:33=kwargs.get("hf_private", False)',
        "a private repo; default false",
        (
            {"save.push_to_hub": True, "save.hf_repo_id": "me/run", "save.hf_private": True},
            {"model_card_private": True},
        ),
    ),
    ("dataset", "folder_path"): _row(
        f"{CM}:921=kwargs.get('folder_path', None)",
        "the image folder; a relative path is opened from the working directory",
        ({}, {"datasets.0.instance_data_dir": "{cwd}/data"}),
    ),
    ("dataset", "caption_ext"): _row(
        f"{CM}:941-944=self.caption_ext = '.' + self.caption_ext {DM}:345-354=prompt = clean_caption(prompt) "
        f"{DM}:99-110=return caption",
        "each image's .txt file read whole (clean_caption returns it as it is)",
        (
            {"datasets.0.caption_ext": ".txt"},
            {"datasets.0.caption_strategy": "textfile", "datasets.0.disable_multiline_split": True},
        ),
    ),
    ("dataset", "caption_dropout_rate"): _row(
        f"{CM}:956=kwargs.get('caption_dropout_rate', 0.0) {DM}:403-408=not self.dataset_config.cache_text_embeddings "
        f"{BASE}:153-155=raw_dataset['cache_text_embeddings'] = True",
        "the empty caption with this chance, unless text embeddings are cached (train's switch sets every dataset's)",
        ({"datasets.0.caption_dropout_rate": 0.05}, {"caption_dropout_probability": 0.05}),
        (
            {"datasets.0.caption_dropout_rate": 0.05, "train.cache_text_embeddings": True},
            {"caption_dropout_probability": 0.0},
        ),
    ),
    ("dataset", "num_repeats"): _row(
        f"{CM}:1002=kwargs.get('num_repeats', 1)",
        "the dataset N times per epoch",
        ({"datasets.0.num_repeats": 3}, {"datasets.0.repeats": 2}),
    ),
    ("dataset", "buckets"): _row(
        f"{CM}:949=kwargs.get('buckets', True)",
        "aspect buckets on (the default)",
        ({"datasets.0.buckets": True}, {"datasets.0.crop": UNSET}),
    ),
    ("dataset", "type"): _row(
        f"{CM}:919=kwargs.get('type', 'image')",
        "an image dataset",
        ({"datasets.0.type": "image"}, {"datasets.0.dataset_type": UNSET}),
    ),
    ("train", "batch_size"): _row(
        f"{CM}:393=kwargs.get('batch_size', 1)", "the micro-batch", ({"train.batch_size": 2}, {"train_batch_size": 2})
    ),
    ("train", "steps"): _row(
        f"{CM}:380=kwargs.get('steps', 1000)",
        "loop steps; default 1000",
        ({"train.steps": None}, {"max_train_steps": 1000}),
    ),
    ("train", "lr"): _row(
        f"{CM}:381=kwargs.get('lr', 1e-6) {OPT}:78-79=lr=float(learning_rate)",
        "the learning rate; default 1e-6",
        ({"train.lr": None}, {"learning_rate": 1e-6}),
        ({"train.lr": "3e-4"}, {"learning_rate": 3e-4}),
    ),
    ("train", "unet_lr"): _row(
        f"{CM}:382=kwargs.get('unet_lr', self.lr)",
        "the denoiser's rate, default lr",
        ({"train.unet_lr": 5e-5}, {"learning_rate": 5e-5}),
    ),
    ("train", "text_encoder_lr"): _row(
        f"{CM}:383=kwargs.get('text_encoder_lr', self.lr)",
        "the text encoder's rate",
        (
            {
                "model.arch": "sdxl",
                "train.noise_scheduler": "ddpm",
                "train.train_text_encoder": True,
                "train.text_encoder_lr": 5e-5,
            },
            {"text_encoder_lr": 5e-5},
        ),
    ),
    ("train", "optimizer_params"): _row(
        f"{CM}:388=kwargs.get('optimizer_params', {{}}) {OPT}:79=**optimizer_params",
        "keyword arguments of the optimizer",
        (
            {"train.optimizer_params": {"weight_decay": 1e-4, "betas": [0.9, 0.99]}},
            {"weight_decay": 1e-4, "adam_beta2": 0.99},
        ),
    ),
    ("train", "gradient_accumulation"): _row(
        f"{CM}:460=kwargs.get('gradient_accumulation', 1) {BASE}:2565=range(self.train_config.gradient_accumulation)",
        "micro-batches per step (one optimizer step per loop step)",
        ({"train.gradient_accumulation": 4}, {"gradient_accumulation_steps": 4}),
    ),
    ("train", "gradient_checkpointing"): _row(
        f"{CM}:413=kwargs.get('gradient_checkpointing', True)", "default true", ({}, {"gradient_checkpointing": True})
    ),
    ("train", "noise_scheduler"): _row(
        f"{CM}:377=kwargs.get('noise_scheduler', 'ddpm') {BASE}:1195=noise_scheduler == 'flowmatch'",
        "flowmatch for flow models",
        ({}, {"model_family": "flux"}),
    ),
    ("train", "timestep_type"): _row(
        f"{CM}:556=kwargs.get('timestep_type', 'sigmoid') {BASE}:1196-1205=timestep_type == 'linear' "
        f"{BASE}:1312-1317=torch.randint {SAMPLER}:116-133=torch.sigmoid(torch.randn",
        "linear: sigma uniform; sigmoid (default): sigma = 1 - sigmoid(N(0, 1)); both unshifted",
        ({"train.timestep_type": "linear"}, {"timestep_sampling": "uniform", "flow_shift": 1.0}),
        ({}, {"timestep_sampling": "logit_normal", "logit_mean": 0.0, "logit_std": 1.0, "flow_shift": 1.0}),
    ),
    ("train", "content_or_style"): _row(
        f"{CM}:378=kwargs.get('content_or_style', 'balanced') {BASE}:1301-1317=content_or_style == 'balanced'",
        "balanced: the timestep_type draw",
        ({"train.content_or_style": "balanced"}, {"timestep_sampling": "logit_normal"}),
    ),
    ("train", "train_unet"): _row(
        f"{CM}:400=kwargs.get('train_unet', True)",
        "the denoiser trains",
        ({"train.train_unet": True}, {"training_type": UNSET}),
    ),
    ("train", "max_grad_norm"): _row(
        f"{CM}:417=kwargs.get('max_grad_norm', 1.0) {SDT}:2278-2283=clip_grad_norm_",
        "clip the total gradient norm (every optimizer but adafactor)",
        ({"train.max_grad_norm": 0.5}, {"max_grad_norm": 0.5}),
    ),
    ("train", "loss_type"): _row(
        f"{CM}:524=kwargs.get('loss_type', 'mse') {SDT}:915-916=mse_loss",
        "mse: the mean squared error",
        ({"train.loss_type": "mse"}, {"loss_type": "l2"}),
    ),
    ("train", "disable_sampling"): _row(
        f"{CM}:560=kwargs.get('disable_sampling', False) {BASE}:2560-2561=is_sample_step = False",
        "no samples",
        ({"train.disable_sampling": True}, {"validation_prompts": UNSET}),
    ),
    ("model", "name_or_path"): _row(
        f"{CM}:628=kwargs.get('name_or_path', None)", "the model", ({}, {"pretrained_model_name_or_path": "model"})
    ),
    ("model", "arch"): _row(
        f'{CM}:706=kwargs.get("arch", None) {CM}:770-771=self.arch = "flux"',
        "the architecture (flex1 is read as flux)",
        ({"model.arch": "wan22_14b"}, {"model_family": "wan"}),
        ({"model.arch": "sdxl", "train.noise_scheduler": "ddpm"}, {"model_family": "sdxl"}),
        ({"model.arch": "flex1"}, {"model_family": "flux"}),
    ),
    ("model", "is_flux"): _row(
        f"{CM}:637=kwargs.get('is_flux', False) {CM}:812-813=self.arch = 'flux'",
        "flux where arch is unset",
        ({"model.arch": None, "model.is_flux": True}, {"model_family": "flux"}),
    ),
    ("model", "is_xl"): _row(
        f"{CM}:632=kwargs.get('is_xl', False) {CM}:804-805=self.arch = 'sdxl'",
        "sdxl where arch is unset",
        ({"model.arch": None, "model.is_xl": True, "train.noise_scheduler": "ddpm"}, {"model_family": "sdxl"}),
    ),
    ("model", "is_v3"): _row(
        f"{CM}:636=kwargs.get('is_v3', False) {CM}:802-803=self.arch = 'sd3'",
        "sd3 where arch is unset",
        ({"model.arch": None, "model.is_v3": True}, {"model_family": "sd3"}),
    ),
    ("model", "is_v2"): _row(
        f"{CM}:631=kwargs.get('is_v2', False) {CM}:800-801=self.arch = 'sd2'",
        "sd2 where arch is unset (it wins over the other switches)",
        ({"model.arch": None, "model.is_v2": True, "train.noise_scheduler": "ddpm"}, {"model_family": "sd"}),
    ),
    ("model", "model_kwargs"): _row(
        f'{CM}:757=kwargs.get("model_kwargs", {{}}) {WAN22}:196-197=model_kwargs.get("train_high_noise", True)',
        "train_high_noise / train_low_noise pick the experts; default both",
        (
            {"model.arch": "wan22_14b", "model.model_kwargs": {"train_high_noise": True, "train_low_noise": False}},
            {"train_stages": "high"},
        ),
    ),
    ("model", "vae_path"): _row(
        f"{CM}:646=kwargs.get('vae_path', None)",
        "a separate VAE",
        ({"model.vae_path": "vae"}, {"pretrained_vae_model_name_or_path": "vae"}),
    ),
    ("model", "is_v_pred"): _row(
        f"{CM}:644=kwargs.get('is_v_pred', False)",
        "v-prediction",
        (
            {"model.arch": "sdxl", "train.noise_scheduler": "ddpm", "model.is_v_pred": True},
            {"prediction_type": "v_prediction"},
        ),
    ),
    ("model", "extras_name_or_path"): _row(
        f'{CM}:736=kwargs.get("extras_name_or_path", self.name_or_path)',
        "default name_or_path",
        ({"model.extras_name_or_path": "model"}, {"pretrained_model_name_or_path": "model"}),
    ),
    ("sample", "prompts"): _row(
        f"{CM}:104-111=kwargs.get('prompts', []) {CM}:1400-1401=p_split = prompt.split('--') "
        f"{CM}:1452-1453=self.ctrl_img = content",
        "the sample prompts (each one a sample item); a prompt's text ends at its first `--`, `--ctrl_img` "
        "names the image an edit model renders from",
        ({"sample.prompts": ["[trigger] cat"], "trigger_word": "sks"}, {"validation_prompts": ["sks cat"]}),
        (
            {"sample.prompts": ["smile  --ctrl_img in/a.png", "frown --ctrl_img in/a.png"]},
            {"validation_prompts": ["smile", "frown"], "validation_image": "{cwd}/in/a.png"},
        ),
    ),
    ("sample", "sample_every"): _row(
        f"{CM}:82=kwargs.get('sample_every', 100)", "every N steps; default 100", ({}, {"validation_steps": 100})
    ),
    ("sample", "sample_steps"): _row(
        f"{CM}:90=kwargs.get('sample_steps', 20)",
        "sampler steps; default 20",
        ({}, {"validation_num_inference_steps": 20}),
    ),
    ("sample", "guidance_scale"): _row(
        f"{CM}:89=kwargs.get('guidance_scale', 7)", "guidance; default 7", ({}, {"validation_guidance_scale": 7})
    ),
    ("sample", "width"): _row(
        f"{CM}:84=kwargs.get('width', 512)",
        "width; default 512",
        ({"sample.width": 768}, {"validation_resolution": "768x512"}),
    ),
    ("sample", "height"): _row(
        f"{CM}:85=kwargs.get('height', 512)",
        "height; default 512",
        ({"sample.height": 256}, {"validation_resolution": "512x256"}),
    ),
    ("sample", "neg"): _row(
        f"{CM}:86=kwargs.get('neg', False)",
        "the negative prompt",
        ({"sample.neg": "blurry"}, {"validation_negative_prompt": "blurry"}),
        ({"sample.neg": ""}, {"validation_negative_prompt": UNSET}),
    ),
    ("sample", "seed"): _row(
        f"{CM}:87=kwargs.get('seed', 0)", "the sample seed; default 0", ({}, {"validation_seed": 0})
    ),
    ("sample", "num_frames"): _row(
        f"{CM}:98=kwargs.get('num_frames', 1) toolkit/models/wan21/wan21.py:497-498=AggressiveWanUnloadPipeline(",
        "frames of a sample video; diffusers' WanPipeline floors a count to 4k+1 (its pipeline_wan.py:494-498 in "
        "diffusers 0.42.1), the low_vram pipeline skips that and renders (n - 1) // 4 latent frames + 1",
        ({"model.arch": "wan21", "sample.num_frames": 5}, {"validation_num_video_frames": 5}),
        ({"model.arch": "wan21", "sample.num_frames": 40}, {"validation_num_video_frames": 41}),
        ({"model.arch": "wan21", "model.low_vram": True, "sample.num_frames": 40}, {"validation_num_video_frames": 37}),
    ),
    ("sample", "guidance_rescale"): _row(
        f"{CM}:92=kwargs.get('guidance_rescale', 0.0)",
        "guidance rescale",
        (
            {"model.arch": "sdxl", "train.noise_scheduler": "ddpm", "sample.guidance_rescale": 0.7},
            {"validation_guidance_rescale": 0.7},
        ),
    ),
}


@pytest.mark.parametrize("row,index", [(k, i) for k, r in ROWS.items() for i in range(len(r.cases))], ids=str)
def test_same_row_translates_to_ai_toolkits_meaning(tmp_path, row, index):
    fragment, expect = ROWS[row].cases[index]
    native = translated(tmp_path, fragment)
    for key, want in expect.items():
        got = lookup(native, key)
        if isinstance(want, str) and "{cwd}" in want:
            want = want.replace("{cwd}", str(tmp_path))
        assert got is want if want is UNSET else got == want, f"{key}: {got!r}, ai-toolkit's figure {want!r}"


def test_every_same_row_has_evidence():
    same = {(row.section, row.key) for row in AIT_DIALECT if row.kind == "same"}
    missing = sorted(same - set(ROWS))
    assert not missing, f"`same` rows without evidence (write it, or mark them approximated): {missing}"
    assert not sorted(set(ROWS) - same), "evidence for rows that are not `same`"


def _ait_source(path: str) -> list[str]:
    shown = subprocess.run(["git", "-C", str(MIRROR), "show", f"{AIT_COMMIT}:{path}"], capture_output=True, text=True)
    assert shown.returncode == 0, f"{path} is not a file of ai-toolkit at {AIT_COMMIT}"
    return shown.stdout.splitlines()


@pytest.mark.skipif(not MIRROR.is_dir(), reason="no mirror of ostris/ai-toolkit on this machine")
def test_evidence_cites_the_ai_toolkit_lines_that_hold_the_code():
    assert AIT_COMMIT == "27a03a91"
    sources: dict[str, list[str]] = {}
    for key, row in ROWS.items():
        for cite in row.where:
            source = sources.setdefault(cite.path, _ait_source(cite.path))
            lines = "\n".join(source[cite.first - 1 : cite.last])
            assert cite.shows in lines, f"{key}: {cite.path}:{cite.first}-{cite.last} does not hold {cite.shows!r}"


@pytest.mark.skipif(not MIRROR.is_dir(), reason="no mirror of ostris/ai-toolkit on this machine")
def test_ai_toolkit_key_lines_are_where_it_reads_each_key():
    source = _ait_source("toolkit/config_modules.py")
    for section, keys in AIT_KEYS.items():
        for key, (line, _default) in keys.items():
            assert f"'{key}'" in source[line - 1] or f'"{key}"' in source[line - 1], f"{section}.{key}: line {line}"


#: ai-toolkit's files, by the name the notes cite them with.
AIT_FILES = {
    "BaseSDTrainProcess.py": BASE,
    "SDTrainer.py": SDT,
    "__init__.py": EXT,
    "BaseProcess.py": "jobs/process/BaseProcess.py",
    "BaseTrainProcess.py": BTP,
    "adafactor.py": "toolkit/optimizers/adafactor.py",
    "automagic.py": "toolkit/optimizers/automagic.py",
    "buckets.py": "toolkit/buckets.py",
    "config.py": "toolkit/config.py",
    "config_modules.py": CM,
    "custom_flowmatch_sampler.py": SAMPLER,
    "dataloader_mixins.py": DM,
    "ema.py": "toolkit/ema.py",
    "lokr.py": "toolkit/models/lokr.py",
    "optimizer.py": OPT,
    "optimizer_utils.py": "toolkit/optimizers/optimizer_utils.py",
    "prompt_utils.py": "toolkit/prompt_utils.py",
    "quantize.py": "toolkit/util/quantize.py",
    "wan21.py": "toolkit/models/wan21/wan21.py",
    "wan22_14b_model.py": WAN22,
}

#: Every ai-toolkit line the table's notes, the optimizer warnings and the dialect's code cite (``file.py:N`` or
#: ``file.py:A-B``, several ranges after one file split by ", " or " and ") -> code those lines must hold.
NOTE_CITES = {
    "BaseProcess.py:21": "self.name = self.get_conf('name', self.job.name)",
    "BaseTrainProcess.py:45": "os.path.join(self.training_folder, self.name)",
    "config_modules.py:60-65": "kwargs.get('ctrl_img_1', self.ctrl_img)",
    "config_modules.py:1396-1455": "p_split = prompt.split('--')",
    "wan21.py:497-498": "pipeline = AggressiveWanUnloadPipeline(",
    "BaseSDTrainProcess.py:144": "self.get_conf('datasets', None)",
    "BaseSDTrainProcess.py:798-803": "decay=self.train_config.ema_config.ema_decay",
    "BaseSDTrainProcess.py:1195-1225": "timestep_type=timestep_type",
    "BaseSDTrainProcess.py:1301-1318": "content_or_style == 'balanced'",
    "BaseSDTrainProcess.py:2604-2615": "optimizer_step_at = self.train_config.gradient_accumulation_steps",
    "BaseSDTrainProcess.py:2806": "self.grad_accumulation_step += 1",
    "SDTrainer.py:1673": "if batch.prompt_embeds is not None",
    "SDTrainer.py:1673-1677": "# use the cached embeds",
    "SDTrainer.py:1679": "self.cached_blank_embeds",
    "SDTrainer.py:1679-1688": "embeds_to_use = self.cached_trigger_embeds",
    "SDTrainer.py:2278": "self.train_config.optimizer != 'adafactor'",
    "__init__.py:8-44": 'uid = "diffusion_trainer"',
    "adafactor.py:195-204": "return param_scale * rel_step_sz",
    "adafactor.py:359-361": "copy_stochastic(p, p_data_fp32)",
    "automagic.py:12-26": "self.lr = 1e-6",
    "automagic.py:24-26": "if self.lr > 1e-3:",
    "automagic.py:218-239": "exp_avg_sq.rsqrt().mul_(grad)",
    "automagic.py:246-266": "lr_mask - self.lr_bump",
    "automagic.py:252-258": "lr_mask + self.lr_bump,  # Increase lr",
    "automagic.py:262-266": "min=self.min_lr",
    "automagic.py:271": "state['lr_mask'] = Auto8bitTensor(new_lr)",
    "automagic.py:300-302": "state['last_polarity'] = torch.zeros(",
    "buckets.py:17-48": "target_pixels = min(total_pixels, max_pixels)",
    "config.py:14-17": "def get_cwd_abs_path(path):",
    "config.py:14-110": "return preprocess_config(config, name)",
    "config.py:38-51": 'config_string.replace("[name]", name)',
    "config.py:54-65": "tag:yaml.org,2002:float",
    "config.py:105": "real_config_path.endswith('.yaml')",
    "config_modules.py:172-179": "if rank is not None:",
    "config_modules.py:172-182": "self.linear: int = 4",
    "config_modules.py:184-185": "kwargs.get('linear_alpha', self.alpha)",
    "config_modules.py:204-209": "self.linear = 9999999999",
    "config_modules.py:210-211": "kwargs.get('lokr_factor', -1)",
    "config_modules.py:387-388": "kwargs.get('optimizer', 'adamw')",
    "config_modules.py:395": "kwargs.get('dtype', 'fp32')",
    "config_modules.py:685-687": 'kwargs.get("qtype", "qfloat8")',
    "config_modules.py:742-743": "self.qtype.split('|')",
    "config_modules.py:764-768": "self.arch.split(':')[0]",
    "config_modules.py:764-821": "self.arch = 'sd1'",
    "config_modules.py:799-821": "elif kwargs.get('is_flux', False):",
    "config_modules.py:828": "kwargs.get('ema_decay', 0.999)",
    "config_modules.py:1059": "kwargs.get('shrink_video_to_frames', True)",
    "config_modules.py:1095-1113": "def preprocess_dataset_raw_config",
    "custom_flowmatch_sampler.py:116-133": "torch.sigmoid(torch.randn(",
    "custom_flowmatch_sampler.py:143-161": "if self.config.use_dynamic_shifting:",
    "dataloader_mixins.py:99": "def clean_caption(caption):",
    "dataloader_mixins.py:358-363": "prompt = self.dataset_config.default_caption",
    "dataloader_mixins.py:403": "not self.dataset_config.cache_text_embeddings",
    "dataloader_mixins.py:563-566": "Distribute frames evenly across the entire video",
    "ema.py:117-124": "one_minus_decay = 1.0 - decay",
    "lokr.py:42-45": "m = factor",
    "lokr.py:46-61": "if factor == -1:",
    "optimizer.py:12-110": "lower_type = optimizer_type.lower()",
    "optimizer.py:46-49": "use_lr = 1.0",
    "optimizer.py:46-54": "Prodigy(params, lr=use_lr, eps=1e-6",
    "optimizer.py:54": "Prodigy(params, lr=use_lr, eps=1e-6",
    "optimizer.py:66-71": "AdamW8bit(params, lr=learning_rate, eps=1e-6",
    "optimizer.py:70-71": "AdamW8bit(params, lr=learning_rate, eps=1e-6",
    "optimizer.py:76-79": "torch.optim.AdamW(params, lr=float(learning_rate), eps=1e-6",
    "optimizer.py:88-96": "optimizer_params['warmup_init'] = False",
    "optimizer_utils.py:168-181": ".to(torch.int8)",
    "prompt_utils.py:720-742": 'output_prompt = replace_with + " " + output_prompt',
    "quantize.py:42-49": '"float8": Float8WeightOnlyConfig()',
    "quantize.py:65-72": "return qtypes[qtype]",
    "wan22_14b_model.py:196-197": 'model_kwargs.get("train_high_noise", True)',
}

#: ``file.py:`` and its ranges, as the notes write them.
NOTE_REF = re.compile(r"([\w/]+\.py):(\d+(?:-\d+)?(?:(?:, | and )\d+(?:-\d+)?)*)")
AITOOLKIT_CODE = Path(__file__).parent.parent / "simpletuner" / "configuration" / "aitoolkit"


def _note_references() -> set[str]:
    texts = [row.note for row in AIT_DIALECT] + list(OPTIMIZER_DIFFERENCES.values())
    texts += [path.read_text() for path in sorted(AITOOLKIT_CODE.glob("*.py"))]
    return {
        f"{match[1].rsplit('/', 1)[-1]}:{lines}"
        for text in texts
        for match in NOTE_REF.finditer(text)
        for lines in re.split(r", | and ", match[2])
    }


def test_every_ai_toolkit_line_the_notes_cite_has_a_check():
    missing = sorted(_note_references() - set(NOTE_CITES))
    assert not missing, f"cited without a snippet in NOTE_CITES (add the code those lines hold): {missing}"
    assert not sorted(set(NOTE_CITES) - _note_references()), "NOTE_CITES holds references no note makes"


@pytest.mark.skipif(not MIRROR.is_dir(), reason="no mirror of ostris/ai-toolkit on this machine")
def test_the_notes_cite_the_ai_toolkit_lines_that_hold_the_code():
    sources: dict[str, list[str]] = {}
    for reference, shows in NOTE_CITES.items():
        name, lines = reference.split(":")
        first, _, last = lines.partition("-")
        source = sources.setdefault(name, _ait_source(AIT_FILES[name]))
        held = "\n".join(source[int(first) - 1 : int(last or first)])
        assert shows in held, f"{reference} ({AIT_FILES[name]}) does not hold {shows!r}"


# --- behaviours, against figures computed from ai-toolkit's formulas --------------------------------------------------


def test_timestep_draws_are_ai_toolkits():
    # sigmoid (custom_flowmatch_sampler.py:120-133 + BaseSDTrainProcess.py:1312): sigma = 1 - sigmoid(z), z ~ N(0, 1),
    # one of 1000 sorted draws picked uniformly: P(sigma < 0.5) = 0.5, P(sigma < sigmoid(-1) = 0.268941) = 0.158655.
    u = noise.sample_u(200_000, torch.Generator().manual_seed(0), "logit_normal", 0.0, 1.0)
    assert abs(float((u < 0.5).float().mean()) - 0.5) < 0.005
    assert abs(float((u < 0.268941).float().mean()) - 0.158655) < 0.005
    # linear (custom_flowmatch_sampler.py:116-119): sigma = linspace(1000, 1, 1000)[randint(0, 999)] / 1000, so its
    # mean is 0.501 and P(sigma < 0.25) = 0.249; ours draws sigma uniform in (0, 1): the same within 1/1000.
    grid = torch.linspace(1000, 1, 1000)[:999] / 1000
    assert math.isclose(float(grid.mean()), 0.501, abs_tol=1e-4)
    u = noise.sample_u(200_000, torch.Generator().manual_seed(1), "uniform")
    assert abs(float(u.mean()) - float(grid.mean())) < 0.005
    assert abs(float((u < 0.25).float().mean()) - float((grid < 0.25).float().mean())) < 0.005


#: ai-toolkit's get_bucket_for_image_size (toolkit/buckets.py:17-48) at divisibility 64, computed from its formula:
#: (width, height, resolution) -> its bucket. The row `resolution` is approximated: ours differs where shown.
AIT_BUCKETS = {
    (1024, 1024, 512): (512, 512),
    (1024, 1024, 1024): (1024, 1024),
    (1920, 1080, 768): (1024, 576),
    (1920, 1080, 1024): (1344, 768),
    (1200, 800, 512): (576, 448),
    (300, 200, 512): (320, 192),
}


def test_square_and_16_9_buckets_match_ai_toolkits_and_the_warning_names_where_they_differ():
    for (w, h, res), theirs in AIT_BUCKETS.items():
        ours = bucket_for(w, h, res, 64)
        if (w, h) in ((1200, 800), (300, 200)):
            assert ours != theirs  # named in the `resolution` row's warning
        else:
            assert ours == theirs, f"{w}x{h} at {res}: {ours} here, {theirs} in ai-toolkit"
    note = next(r.note for r in AIT_DIALECT if (r.section, r.key) == ("dataset", "resolution"))
    assert "576x448 there, 640x448 here" in note and "320x192 there" in note


def test_migration_guide_is_generated_from_the_table():
    from simpletuner.configuration.docs import render_migrating_ai_toolkit

    doc = (Path(__file__).parent.parent / "documentation" / "MIGRATING_FROM_AI_TOOLKIT.md").read_text()
    assert doc == render_migrating_ai_toolkit(), "run `python -m simpletuner.configuration.docs`"
    for row in AIT_DIALECT:
        assert f"| `{row.key}` | {row.kind} |" in doc, row


# --- approximated rows: what the translation writes and the warning that says what differs ------------------------


def _report(tmp_path: Path, fragment: dict[str, Any]) -> tuple[dict, str]:
    native, report = ait.translate(job(fragment), None, tmp_path)
    validate_config(native, check_files=False)
    return native, "\n".join(report.approximated)


#: ai-toolkit's optimizer name -> (fragment, what we must write). Figures from toolkit/optimizer.py at AIT_COMMIT:
#: adamw / adam: torch's class, eps=1e-6 (optimizer.py:76-79), torch's weight decay 0.01 / 0; adamw8bit:
#: bitsandbytes' AdamW8bit, eps=1e-6 (optimizer.py:70-71), its weight decay 0.01; prodigy: prodigyopt's Prodigy,
#: eps=1e-6 and lr 1.0 when below 0.1 (optimizer.py:46-54), its weight decay 0; automagic: Automagic(lr, **params)
#: (optimizer.py:97-99) with min_lr 1e-7, max_lr 1e-3, lr_bump 1e-6, weight_decay 0 and a start above 1e-3 reset to
#: 1e-6 (toolkit/optimizers/automagic.py:12-26); adafactor: ai-toolkit's Adafactor with relative_step,
#: scale_parameter, warmup_init off (optimizer.py:88-96) and no gradient clipping (SDTrainer.py:2278).
OPTIMIZER_CASES = {
    "adamw": ({}, {"optimizer": "adamw", "adam_epsilon": 1e-6, "weight_decay": 0.01, "learning_rate": 1e-4}),
    "adam": ({}, {"optimizer": "adam", "adam_epsilon": 1e-6, "weight_decay": 0.0}),
    "adamw8bit": ({}, {"optimizer": "bnb-adamw8bit", "adam_epsilon": 1e-6, "weight_decay": 0.01}),
    "prodigy": ({}, {"optimizer": "prodigy", "adam_epsilon": 1e-6, "weight_decay": 0.0, "learning_rate": 1.0}),
    "automagic": (
        {"train.lr": 1e-2},
        {"optimizer": "automagic", "weight_decay": 0.0, "learning_rate": 1e-6, "min_lr": 1e-7, "max_lr": 1e-3},
    ),
    "adafactor": ({}, {"optimizer": "torch-adafactor", "max_grad_norm": None, "learning_rate": 1e-4}),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZER_CASES))
def test_each_optimizer_gets_ai_toolkits_arguments_and_warns_what_differs(tmp_path, name):
    fragment, expect = OPTIMIZER_CASES[name]
    native, warned = _report(tmp_path, {"train.optimizer": name, **fragment})
    config = validate_config(native, check_files=False)
    for key, want in expect.items():
        assert getattr(config, key) == want, f"{name}: {key} {getattr(config, key)!r}, ai-toolkit's {want!r}"
    if name in ("adamw", "adam", "adamw8bit"):
        assert "train.optimizer" not in warned  # the same class and arguments
    else:
        assert f"`train.optimizer`: {OPTIMIZER_DIFFERENCES[name]}" in warned


def test_unload_text_encoder_trains_on_the_trigger_word_as_ai_toolkit_does(tmp_path):
    # SDTrainer.py:1679-1688: without cached embeddings every image gets the trigger word's embedding
    native, warned = _report(tmp_path, {"train.unload_text_encoder": True, "trigger_word": "sks"})
    assert native["datasets"][0]["caption_strategy"] == "instance_prompt"
    assert native["datasets"][0]["instance_prompt"] == "sks" and "`train.unload_text_encoder`" in warned
    # SDTrainer.py:1673-1677: with cached text embeddings the captions train
    native, _ = _report(
        tmp_path, {"train.unload_text_encoder": True, "train.cache_text_embeddings": True, "trigger_word": "sks"}
    )
    assert native["datasets"][0]["caption_strategy"] == "textfile"
    # without a trigger word ai-toolkit trains on the empty prompt: not trained here, it stops
    with pytest.raises(DialectError, match="train.unload_text_encoder"):
        ait.translate(job({"train.unload_text_encoder": True}), None, tmp_path)


@pytest.mark.parametrize(
    "fragment,expect,key",
    [
        (
            {"datasets": None, "dataset": {"folder_path": "data", "resolution": 256}},
            {"datasets.0.resolution": 256},
            None,
        ),
        (
            {"train.optimizer": None, "optimizer": {"name": "automagic", "high_noise_lr_bump": 1e-6}},
            {"optimizer": "automagic", "high_noise_lr_bump": 1e-6, "weight_decay": 0.0},
            "optimizer",
        ),
        (
            {"datasets.0.augmentations_cache_mode": "refresh_each_epoch"},
            {"augmentations_cache_mode": "refresh_each_epoch"},
            None,
        ),
        ({"train.mixed_precision": "bf16"}, {"mixed_precision": "bf16"}, None),
        (
            {"train.gradient_accumulation_steps": 2},
            {"gradient_accumulation_steps": 2, "max_train_steps": 10},
            "train.gradient_accumulation_steps",
        ),
    ],
    ids=["dataset", "optimizer", "augmentations_cache_mode", "mixed_precision", "gradient_accumulation_steps"],
)
def test_the_gh200_forks_keys_and_legacy_accumulation_translate_as_their_rows_say(tmp_path, fragment, expect, key):
    native, warned = _report(tmp_path, fragment)
    for dotted, want in expect.items():
        assert lookup(native, dotted) == want, dotted
    if key is not None:
        assert f"`{key}`" in warned


@pytest.mark.parametrize(
    "fragment,expect,key,says",
    [
        (  # SDTrainer.py:2278 compares the name as written: adafactor clips nothing, whatever max_grad_norm says
            {"train.optimizer": "adafactor", "train.max_grad_norm": 0.5},
            {"max_grad_norm": None},
            None,
            None,
        ),
        ({"train.optimizer": "Adafactor", "train.max_grad_norm": 0.5}, {"max_grad_norm": 0.5}, None, None),
        (  # automagic.py:252-258: its own per-element rates; a schedule changes nothing there
            {"train.optimizer": "automagic", "train.lr": 1e-6, "train.lr_scheduler": "cosine"},
            {"lr_scheduler": "constant", "learning_rate": 1e-6},
            "train.lr_scheduler",
            "never reads the scheduled lr",
        ),
        (  # automagic.py:262-266: every rate is clamped into [min_lr, max_lr] at the first step
            {"train.optimizer": "automagic", "train.lr": 1e-8},
            {"learning_rate": 1e-7},
            "train.lr",
            "below Automagic's min_lr 1e-07",
        ),
        (  # quantize.py:42-49: float8 is torchao's there
            {"model.quantize": True, "model.qtype": "float8"},
            {"base_model_precision": "qfloat8"},
            "model.quantize",
            "torchao's float8",
        ),
        (  # lokr.py:42-45: a positive factor orders the Kronecker factors otherwise than LyCORIS
            {"network": {"type": "lokr", "linear": 4, "lokr_factor": 4}},
            {"lycoris.factor": 4},
            "network.lokr_factor",
            "lokr.py:42-45",
        ),
    ],
    ids=["adafactor", "Adafactor-clips", "automagic-cosine", "automagic-below-min", "float8", "lokr-factor"],
)
def test_optimizer_and_network_settings_take_the_meaning_ai_toolkits_code_gives_them(
    tmp_path, fragment, expect, key, says
):
    native, warned = _report(tmp_path, fragment)
    for dotted, want in expect.items():
        assert lookup(native, dotted) == want, dotted
    if key is None:
        return
    line = next(line for line in warned.splitlines() if line.startswith(f"`{key}`"))
    assert says in line
