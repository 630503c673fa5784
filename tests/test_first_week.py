"""Small things a newcomer hit in their first week (issue 29, item 5; audits/NEWCOMER-3.md).

Each test states what the user saw and what they get now: install hints that name this project,
config errors before torch is imported, Ctrl-C lines that name the phase, the staging and speed
figures, ``cache verify``'s word for an unreadable image, the demo's resume hint, ``zoo --help``,
and the README's documentation list.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[1]


# --- a config error is answered before torch is imported ----------------------------------------
def test_a_config_error_is_reported_before_torch_is_imported(tmp_path):
    """A typo'd config took 18 s to refuse, 10 of them importing torch (through the trainer's modules)."""
    data = tmp_path / "data"
    data.mkdir()
    config = tmp_path / "cfg.json"
    config.write_bytes(
        orjson.dumps(
            {
                "pretrained_model_name_or_path": str(tmp_path / "model"),
                "output_dir": str(tmp_path / "out"),
                "lerning_rate": 1e-4,
                "max_train_steps": 10,
                "datasets": [{"id": "d", "type": "local", "instance_data_dir": str(data)}],
            }
        )
    )
    probe = (
        "import sys\n"
        "from simpletuner.cli import main\n"
        f"code = main(['train', '--config', {str(config)!r}])\n"
        "print('exit', code, 'torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "did you mean 'learning_rate'" in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "exit 2 torch imported: False", done.stdout + done.stderr[-2000:]


# --- Ctrl-C names the phase it came in -----------------------------------------------------------
@pytest.mark.parametrize(
    "fault, words",
    [
        # two minutes after the scan's summary, the preflight was sizing the models: not "the dataset scan"
        ("phase:memory_check:SIGINT", "stopped by SIGINT during the memory check before the cache fill: nothing"),
        ("step:load_vae:SIGINT", "stopped by SIGINT during the cache fill, while loading the VAE: nothing trained"),
    ],
)
def test_ctrl_c_before_the_cache_fill_names_what_was_running(fault, words, make_config, monkeypatch, capsys):
    from simpletuner.cli.train import main as train_main
    from simpletuner.faults import reset_fault_counts
    from simpletuner.training.reliability import RunSignals

    config = Path(make_config()["output_dir"]).parent / "cfg.json"
    config.write_bytes(orjson.dumps(make_config()))
    monkeypatch.setenv("SIMPLETUNER_FAULT", fault)
    reset_fault_counts()
    assert train_main(["--config", str(config)]) == 130
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("stopped")]
    assert len(lines) == 1 and lines[0].startswith(words), lines
    assert RunSignals.installed() is None


# --- gh200_runtime.json: `*_in_use` is what holds the entries ---------------------------------------
@pytest.mark.parametrize(
    "reason, cuda, in_use",
    [
        (None, True, "unified_memory"),  # managed memory works: the caches are in it
        ("this PyTorch build (2.13.0+cpu) has no CUDA", False, "memory"),  # the newcomer's CPU box: plain RAM
        ("cuda-bindings not installed", True, "memory"),  # CUDA without managed memory: pinned CPU memory
    ],
)
def test_runtime_record_says_which_memory_the_unified_caches_use(
    reason, cuda, in_use, make_config, tmp_path, monkeypatch
):
    from fake_cuda import FakeRuntime

    from simpletuner.configuration import load_config
    from simpletuner.gh200 import uvm
    from simpletuner.gh200.wiring import RUNTIME_FILE, configure_runtime
    from simpletuner.hardware.runtime import use_runtime
    from simpletuner.state import StateTracker
    from simpletuner.training.accumulation import build_accumulation

    for name in (uvm.ENV_VAR, uvm.ENV_ALIAS):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "cfg.json"
    config.write_bytes(
        orjson.dumps(
            make_config(cache_config={"vae_cache_type": "unified_memory", "text_cache_type": "unified_memory"})
        )
    )
    loaded = load_config(str(config))
    state = StateTracker(loaded.config, loaded.raw)
    uvm._reset_for_tests()
    try:
        with use_runtime(FakeRuntime(reason=reason, cuda=cuda)):
            configure_runtime(
                state.config, 1, True, tmp_path / "out", accumulation=build_accumulation(state.config, 1).state_dict()
            )
    finally:
        uvm._reset_for_tests()
    written = orjson.loads((tmp_path / "out" / RUNTIME_FILE).read_bytes())
    assert written["vae_cache_type"] == written["text_cache_type"] == "unified_memory"  # what was asked
    assert written["vae_cache_type_in_use"] == written["text_cache_type_in_use"] == in_use
    assert written["unified_memory"]["managed_memory_available"] is (reason is None)


# --- in-memory staging: images counted as images, small sets in KB/s ----------------------------
def test_staging_line_counts_images_and_gives_small_rates_in_kb(shapes_dir, tmp_path, caplog):
    """The newcomer saw `60 files, 0.1 MB -> 0.1 MB ... 0 MB/s` for 30 images and their captions."""
    import logging

    from simpletuner.data_backend.in_memory import GH200InMemoryBackend, StagingReport

    images = sorted(p.name for p in shapes_dir.iterdir() if p.suffix == ".png")
    captions = sorted(p.name for p in shapes_dir.iterdir() if p.suffix == ".txt")
    assert images and captions
    with caplog.at_level(logging.INFO, logger="simpletuner.data_backend.in_memory"):
        backend = GH200InMemoryBackend(shapes_dir, id="train_images", num_workers=2)
    line = backend.report.summary("train_images")
    assert line in caplog.text
    assert line.startswith(
        f"staged dataset 'train_images': {len(images)} images (+{len(captions)} captions and other files), "
    )
    assert " 0 MB/s" not in line and " 0.0 MB" not in line
    # the newcomer's figures: 30 images + 30 captions, 0.1 MB in 0.3 s
    small = StagingReport(60, 100_000, 100_000, 0.3, 2, "lz4", images=30).summary("train_images")
    assert small == (
        "staged dataset 'train_images': 30 images (+30 captions and other files), 100 KB -> 100 KB "
        "(ratio 1.00, lz4) in 0.3 s, 333 KB/s, 2 workers"
    )
    large = StagingReport(1200, 512_000_000, 498_300_000, 1.9, 64, "lz4", images=1200).summary("x")
    assert "1200 images, 512.0 MB -> 498.3 MB" in large and "269 MB/s, 64 workers" in large


# --- samples/s with two significant figures ---------------------------------------------------------
def test_samples_per_second_has_two_significant_figures_on_the_console_and_the_bar():
    """A step of more than 20 s showed `0.0 samples/s` (run b of the walkthrough, 12–98 s per step)."""
    from simpletuner.training.metrics import log_line, progress_postfix

    window = {"loss": 0.5, "lr": 1e-4, "step_time_s": 49.0, "data_wait_share": 0.0}
    for rate, shown in [(2 / 49, "0.041"), (2 / 98, "0.020"), (2.34, "2.3"), (12.3, "12"), (1234.5, "1234")]:
        assert f", {shown} samples/s," in log_line({**window, "samples_per_s": rate})
        assert progress_postfix({**window, "samples_per_s": rate})["samples_s"] == shown


# --- cache verify: an image that does not decode is "unreadable (skipped)", not "encoded on the next run" ---
def test_cache_verify_calls_an_undecodable_image_unreadable(make_config, shapes_dir, tmp_path, capsys):
    import io
    import json
    import shutil

    from PIL import Image
    from training_helpers import train

    from simpletuner.cli.cache import main as cache_main

    data = tmp_path / "data"
    shutil.copytree(shapes_dir, data)
    whole = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(whole, "PNG")
    png = whole.getvalue()
    idat = png.index(b"IDAT")
    # header and end intact (the scan's checks pass), pixel data garbage: found only when decoded for the cache
    (data / "broken.png").write_bytes(png[: idat + 4] + bytes(range(256)) * 2 + png[-12:])
    (data / "broken.txt").write_text("a caption only the broken image has")
    raw = make_config(
        max_train_steps=1,
        max_bad_image_fraction=0.1,
        datasets=[{"id": "shapes", "type": "local", "instance_data_dir": str(data)}],
    )
    train(raw)  # fills the caches; the broken PNG is skipped at the fill
    config = tmp_path / "cfg.json"
    config.write_bytes(orjson.dumps(raw))
    capsys.readouterr()

    assert cache_main(["verify", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "encoded on the next run" not in out, out
    vae, text = out.split("text cache:")
    assert "needed by this config: 13, present: 12, 1 unreadable (skipped)" in vae
    assert f"unreadable {data}/broken.png: cannot decode image" in vae
    assert "1 unreadable (skipped)" in text and "'a caption only the broken image has'" in text

    assert cache_main(["verify", "--config", str(config), "--json"]) == 0
    caches = {c["name"]: c for c in json.loads(capsys.readouterr().out)["caches"]}
    assert caches["vae"]["num_missing"] == 1 and list(caches["vae"]["unreadable"]) == [f"{data}/broken.png"]


# --- the demo's Ctrl-C line gives the demo's own resume command ---------------------------------------
def test_demo_passes_the_command_that_resumes_it(tmp_path, monkeypatch):
    """`simpletuner demo` passes --overwrite (a re-run starts over): the resume is `train` on its config."""
    import argparse

    from simpletuner.cli import demo

    seen = {}

    def fake_train(argv):
        seen["argv"] = argv
        return 130  # as if stopped by Ctrl-C: no before | after picture

    config = tmp_path / "demo_run" / "config.json"
    monkeypatch.setattr(demo, "train_main", fake_train)
    monkeypatch.setattr(demo, "write_demo", lambda root, max_train_steps: config)  # its model and data: not needed
    code = demo.run(argparse.Namespace(dir=str(tmp_path / "demo_run"), steps=2, log_level="INFO"))
    argv = seen["argv"]
    assert code == 130 and "--overwrite" in argv
    assert argv[argv.index("--resume-command") + 1] == f"simpletuner train --config {config}"


def test_ctrl_c_in_the_loop_names_the_resume_command_it_was_given(make_config, monkeypatch, capsys):
    from simpletuner.cli.train import main as train_main
    from simpletuner.faults import reset_fault_counts

    raw = make_config(checkpointing_steps=2)
    config = Path(raw["output_dir"]).parent / "cfg.json"
    config.write_bytes(orjson.dumps(raw))
    monkeypatch.setenv("SIMPLETUNER_FAULT", "checkpoint:files_written:SIGINT")  # during the step-2 checkpoint:
    # the step loop finishes the next step, saves it and stops
    reset_fault_counts()
    resume = f"simpletuner train --config {config}"
    assert train_main(["--config", str(config), "--resume-command", resume]) == 130
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("stopped")]
    assert line.startswith("stopped by SIGINT: saved ") and line.endswith(f"checkpoint-3; resume with `{resume}`")


# --- zoo --help and the README -----------------------------------------------------------------------
def test_zoo_help_lists_the_families_and_the_readme_mentions_zoo(capsys):
    from simpletuner.cli import main
    from simpletuner.testing.zoo import TINY_MODELS

    with pytest.raises(SystemExit):
        main(["zoo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "{" + ",".join(TINY_MODELS) + "}" in help_text
    assert "simpletuner zoo --family sd --out" in (ROOT / "README.md").read_text()


def test_the_readme_lists_every_document():
    """Its list named 9 of the 12 documents; DATA_SOURCES, DISTRIBUTED and MODEL_FAMILIES were missing."""
    readme = (ROOT / "README.md").read_text()
    listed = readme.split("## Documentation", 1)[1].split("\n## ", 1)[0]
    documents = sorted(p.name for p in (ROOT / "documentation").glob("*.md"))
    assert len(documents) >= 12
    assert [name for name in documents if f"](documentation/{name})" not in listed] == []


# --- `simpletuner estimate` again on the same config: read, not remade -------------------------------
def test_a_second_estimate_of_the_same_config_is_read_from_the_estimate_cache(
    zoo_config, tmp_path, monkeypatch, capsys
):
    """The newcomer ran `estimate --config cfg.json`, then `--gpu rtx4090` (over 300 s at load 34): the same
    estimate twice. Kept on disk, the second is read; anything in its key that changes is a new estimate."""
    import json

    from simpletuner.cli import main
    from simpletuner.memory import autoconfig

    monkeypatch.setenv("SIMPLETUNER_ESTIMATE_CACHE", str(tmp_path / "estimates"))
    config = tmp_path / "cfg.json"
    config.write_bytes(orjson.dumps(zoo_config("sd", mixed_precision="bf16")))

    def estimate(*extra):
        capsys.readouterr()
        code = main(["estimate", "--config", str(config), "--json", *extra])
        assert code in (0, 1), capsys.readouterr().err
        return json.loads(capsys.readouterr().out)

    first = estimate()
    assert first["from_estimate_cache"] is False and len(list((tmp_path / "estimates").glob("*.json"))) == 1
    made = []
    real = autoconfig.estimate_memory
    monkeypatch.setattr(autoconfig, "_default_estimate", autoconfig._default_estimate)  # the same function
    monkeypatch.setattr(autoconfig, "estimate_memory", lambda *a, **k: made.append(a) or real(*a, **k))
    again = estimate("--gpu", "rtx4090", "--set", "max_train_steps=99")  # neither changes the estimate
    assert again["from_estimate_cache"] is True and made == []
    assert again["estimate"] == first["estimate"] and again["total_bytes"] == first["total_bytes"]
    other = estimate("--set", "lora_rank=8")  # a key that changes it: estimated again
    assert other["from_estimate_cache"] is False and len(made) == 1
    assert other["estimate"]["trainable_weights"] != first["estimate"]["trainable_weights"]
