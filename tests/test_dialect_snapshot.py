"""tests/data/simpletuner_keys.json (SimpleTuner's config keys) and the tail of the dialect table.

The snapshot must be what scripts/snapshot_simpletuner_keys.py reads from a SimpleTuner checkout at the
recorded commit; where no checkout is at hand (CI), the file's own shape is checked. The script itself
is run on a small git repository made here, whose keys are known by construction.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from simpletuner.configuration.simpletuner.unmapped import TAIL, TAIL_DEFAULTS

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "data" / "simpletuner_keys.json"
SCRIPT = ROOT / "scripts" / "snapshot_simpletuner_keys.py"
MIRROR = Path(os.environ.get("SIMPLETUNER_MIRROR", "/work/.mirror/bghira+SimpleTuner/repo"))
KEY = re.compile(r"^[a-z][a-z0-9_]*$")


def _script():
    spec = importlib.util.spec_from_file_location("snapshot_simpletuner_keys", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _snapshot() -> dict:
    return json.loads(SNAPSHOT.read_text(encoding="utf-8"))


def _has_commit(repo: Path, commit: str) -> bool:
    if shutil.which("git") is None or not repo.exists():
        return False
    probe = subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    return probe.returncode == 0


# --- the file ------------------------------------------------------------------------------------
def test_the_snapshot_records_its_source_and_holds_sorted_unique_keys():
    data = _snapshot()
    source = data["source"]
    assert source["repo"] == "bghira/SimpleTuner"
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"])
    assert source["files"] == sorted(set(source["files"]))
    assert {"documentation/OPTIONS.md", "documentation/DATALOADER.md", "config/config.json.example"} <= set(
        source["files"]
    )
    for name in ("top", "dataset", "dataset_nested"):
        keys = data[name]
        assert keys, name
        assert keys == sorted(set(keys)), f"{name} is not sorted and unique"
    assert all(KEY.match(k) for k in data["top"] + data["dataset"])  # no leading "--", no spaces
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*\.[a-z][a-z0-9_]*", k) for k in data["dataset_nested"])
    # keys every SimpleTuner user writes are there
    assert {"model_family", "pretrained_model_name_or_path", "learning_rate", "data_backend_config"} <= set(data["top"])
    assert {"id", "type", "instance_data_dir", "caption_strategy", "cache_dir_vae"} <= set(data["dataset"])
    assert "video.num_frames" in data["dataset_nested"]


@pytest.mark.skipif(
    not _has_commit(MIRROR, _snapshot()["source"]["commit"]),
    reason="no SimpleTuner checkout with the snapshot's commit (set SIMPLETUNER_MIRROR)",
)
def test_the_snapshot_is_what_the_script_reads_from_simpletuner():
    script = _script()
    commit = _snapshot()["source"]["commit"]
    fresh = script.render(script.snapshot(MIRROR, commit))
    assert fresh == SNAPSHOT.read_text(encoding="utf-8"), (
        "tests/data/simpletuner_keys.json is stale: python scripts/snapshot_simpletuner_keys.py "
        f"--repo {MIRROR} --commit {commit}"
    )


# --- the script, on a repository whose keys are known ---------------------------------------------
OPTIONS_MD = """# Options

Key names are the same as the below `--arguments`; also `simpletuner server --mode trainer --kubeflow`.

### `--learning_rate`

- **What**: the rate. See also `--lr_warmup_steps` and the upstream `--reg-weight`.

### `--checkpoint_step_interval` (alias: `--checkpointing_steps`)

### LTX-2 conditioning options

- Shorthand keys: `ltx2_prefix_conditioning_frames`, `validation_ltx2_video_conditioning`, not `foo_bar`.

### Other

- **`--ltx2_validation_pipeline_mode`**: a mode. Pass `--multi_gpu` to accelerate.

```
usage: train.py [-h] --model_family {flux,sdxl}
options:
  -h, --help            show this help message and exit
  --seed SEED           Seed
```
"""

DATALOADER_MD = """# Dataloader

### `id`

### `instance_data_dir` / `aws_data_prefix`

### `maximum_image_size` and `target_downsample_size`

#### `cache_dir_conditioning_image_embeds`

##### `superresolution`

### Cropping Options

| `audio.sample_rate` | int | 16000 | rate |

```json
[
  {
    "id": "a",
    "type": "local",
    "video": {"num_frames": 49},
    "conditioning": [{"type": "canny", "params": {}}],
  },
  ...
]
```

```json
{"type": "superresolution", "blur_radius": 2}
```
"""


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_script_collects_documented_and_example_keys(tmp_path):
    repo = tmp_path / "st"
    files = {
        "documentation/OPTIONS.md": OPTIONS_MD,
        "documentation/DATALOADER.md": DATALOADER_MD,
        "config/config.json.example": json.dumps({"--model_type": "lora", "resolution": 1024}),
        "config/multidatabackend.json.example": json.dumps([{"id": "x", "crop": True}]),
        # a trailing comma, as in one of SimpleTuner's own examples
        "simpletuner/examples/flux.peft-lora/config.json": '{"tread_config": {"routes": []},\n}',
        "simpletuner/examples/default.json": json.dumps({"_metadata": {"name": "t"}, "config": {"--use_ema": False}}),
        "simpletuner/examples/multidatabackend-small.json": json.dumps([{"id": "y", "dataset_name": "org/set"}]),
        "simpletuner/examples/flux.peft-lora/lycoris_config.json": json.dumps({"algo": "lokr"}),
        "simpletuner/examples/prompts.json": json.dumps({"portrait": "a face"}),
    }
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text, encoding="utf-8")
    _git(repo.parent, "init", "-q", str(repo))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "keys")
    commit = _git(repo, "rev-parse", "HEAD")
    (repo / "config" / "config.json.example").write_text('{"not_committed": 1}', encoding="utf-8")  # read at commit

    script = _script()
    out = tmp_path / "keys.json"
    assert script.main(["--repo", str(repo), "--commit", commit, "--output", str(out)]) == 0
    data = json.loads(out.read_text(encoding="utf-8"))

    assert data["source"] == {
        "repo": "bghira/SimpleTuner",
        "commit": commit,
        "files": [
            "config/config.json.example",
            "config/multidatabackend.json.example",
            "documentation/DATALOADER.md",
            "documentation/OPTIONS.md",
            "simpletuner/examples/flux.peft-lora/config.json",
            "simpletuner/examples/multidatabackend-small.json",
        ],
    }
    assert data["top"] == sorted(
        [
            "learning_rate",  # a heading
            "lr_warmup_steps",  # a mention in prose
            "checkpoint_step_interval",  # a heading, with its alias
            "checkpointing_steps",
            "ltx2_prefix_conditioning_frames",  # the LTX-2 section's bare names
            "validation_ltx2_video_conditioning",
            "ltx2_validation_pipeline_mode",  # a bold bullet
            "model_family",  # the --help listing
            "seed",
            "model_type",  # config.json.example, "--" dropped
            "resolution",
            "tread_config",  # an example config.json with a trailing comma
        ]
    )
    # not keys: "--arguments", the server's "--mode" / "--kubeflow", "--reg-weight", "--multi_gpu",
    # "--help"; the web UI template default.json is not an example config
    assert "use_ema" not in data["top"]
    assert data["dataset"] == sorted(
        [
            "id",
            "instance_data_dir",
            "aws_data_prefix",
            "maximum_image_size",
            "target_downsample_size",
            "cache_dir_conditioning_image_embeds",
            "type",
            "video",
            "conditioning",
            "crop",
            "dataset_name",
            "disable",
            "webshart_optimise_captions",
            "webshart_optimize_captions",
        ]
    )
    assert data["dataset_nested"] == [
        "audio.sample_rate",
        "conditioning.params",
        "conditioning.type",
        "video.num_frames",
    ]


# --- the tail of the dialect table ----------------------------------------------------------------
def test_every_tail_entry_is_a_snapshot_key_with_a_kind_and_a_one_line_note():
    data = _snapshot()
    seen = set()
    for key, section, kind, note in TAIL:
        assert section in ("top", "dataset"), key
        assert kind in ("ignored", "unsupported"), key
        assert key in data[section], f"{section} key {key!r} is not in the snapshot"
        assert note and "\n" not in note and not note.endswith("."), key
        assert (key, section) not in seen, f"{key} ({section}) twice"
        seen.add((key, section))
    assert {("csv_file", "dataset"), ("distillation_config", "top"), ("post_upload_script", "top")} <= seen
    kinds = {(key, section): kind for key, section, kind, _ in TAIL}
    assert kinds[("distillation_config", "top")] == "unsupported"
    assert kinds[("attention_mechanism", "top")] == "ignored"
    assert kinds[("csv_file", "dataset")] == "unsupported"


def test_tail_defaults_belong_to_unsupported_top_keys_and_are_not_off():
    kinds = {key: kind for key, section, kind, _ in TAIL if section == "top"}
    for key, value in TAIL_DEFAULTS.items():
        assert kinds.get(key) == "unsupported", key
        assert value not in (None, False, 0, "", [], {}), key
