"""The `simpletuner` command: its command table, train errors, zoo, and the demo through the real train path."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import orjson
import pytest

from simpletuner.cli import COMMANDS, main


def test_every_command_module_declares_its_arguments_and_runs_them():
    for name, entry in COMMANDS.items():
        module = importlib.import_module(entry.module)
        assert callable(module.add_arguments) and callable(module.run), name


@pytest.mark.parametrize("name", ["train", "cache", "diagnose"])
def test_a_command_that_also_runs_on_its_own_reads_the_same_under_simpletuner(name, capsys):
    own = importlib.import_module(COMMANDS[name].module)
    own_parser = own.build_parser("simpletuner diagnose") if name == "diagnose" else own.build_parser()
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out == own_parser.format_help()

    with pytest.raises(SystemExit) as exit_:  # unknown arguments: said under its own name, as on its own
        main(
            [
                name,
                *{"train": ["--config", "c.json"], "cache": ["verify", "--config", "c.json"]}.get(name, []),
                "--bogus",
            ]
        )
    assert exit_.value.code == 2
    assert f"simpletuner {name}: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_other_commands_leave_unknown_arguments_to_simpletuner(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--bogus"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "simpletuner: error: unrecognized arguments: --bogus"


def test_help_loads_only_the_command_asked_for():
    """`simpletuner --help`, `train --help` and `estimate --help` stay quick: no torch, no other command's
    module (estimate's work, in cli.estimate_run, is imported only when it runs)."""
    probe = (
        "import sys\n"
        "from simpletuner.cli import main\n"
        "for argv in (['--help'], ['train', '--help'], ['estimate', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "watched = ('torch', 'simpletuner.cli.estimate_run', 'simpletuner.cli.demo')\n"
        "print(sorted(m for m in watched if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.splitlines()[-1] == "[]"


def test_train_with_bad_config_exits_2_and_lists_problems(tmp_path, capsys, make_config):
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(make_config(lerning_rate=1, train_batch_size=0)))
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "2 problem(s)" in err and "did you mean 'learning_rate'" in err and "train_batch_size" in err
    assert not (tmp_path / "output").exists(), "a bad config must not create anything"


def test_zoo_writes_a_loadable_pipeline(tmp_path):
    """Quiet, and paying only for what it uses: the zoo quiets the model libraries as the trainer does (torchao is
    not imported, so its failed kernel loads are not printed), and write_demo over a folder that already has its
    model imports no torch."""
    from diffusers import StableDiffusionPipeline

    demo = tmp_path / "demo"
    (demo / "model").mkdir(parents=True)
    (demo / "model" / "model_index.json").write_text("{}")  # write_demo keeps a model that is there
    probe = (
        "import json, sys\n"
        "from simpletuner.cli import main\n"
        "from simpletuner.testing.demo_data import write_demo\n"
        f"write_demo({str(demo)!r})\n"
        "demo_torch = 'torch' in sys.modules\n"
        f"code = main(['zoo', '--family', 'sd', '--out', {str(tmp_path / 'm')!r}])\n"
        "print(json.dumps([demo_torch, code, 'torchao' in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [False, 0, False]
    assert "torchao" not in done.stderr
    assert (demo / "config.json").is_file() and len(list((demo / "data").glob("*.png"))) == 24
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "m", safety_checker=None)
    assert pipe.tokenizer.model_max_length == 77


def test_demo_trains_and_writes_before_and_after_samples(tmp_path, capsys):
    from PIL import Image, ImageChops

    assert main(["demo", "--dir", str(tmp_path / "demo"), "--steps", "4"]) == 0
    out = tmp_path / "demo" / "output"
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    names = sorted(p.name for p in (out / "validation").glob("*.png"))
    assert names == [
        "step_000000_0.png",
        "step_000000_1.png",
        "step_000000_grid.png",
        "step_000004_0.png",
        "step_000004_1.png",
        "step_000004_grid.png",
    ]
    config = orjson.loads((tmp_path / "demo" / "config.json").read_bytes())
    assert config["max_train_steps"] == 4
    printed = capsys.readouterr().out
    assert "LoRA at" in printed

    # One side-by-side picture, named in the final message: per row, step 0 | step 4 of the same image index,
    # each 64 px sample scaled 3x (nearest), under a label strip.
    side_by_side = out / "before_after.png"
    assert f"before | after training (same seed and prompt): {side_by_side}" in printed.splitlines()[-1]
    sheet = Image.open(side_by_side).convert("RGB")
    tile, gap, label = 192, 4, 18
    assert sheet.size == (2 * tile + gap, label + 2 * (tile + gap) - gap + label)
    for row in range(2):
        for col, step in enumerate((0, 4)):
            want = (
                Image.open(out / "validation" / f"step_{step:06d}_{row}.png")
                .convert("RGB")
                .resize((tile, tile), Image.NEAREST)
            )
            x, y = col * (tile + gap), label + row * (tile + gap)
            got = sheet.crop((x, y, x + tile, y + tile))
            assert ImageChops.difference(got, want).getbbox() is None, (row, step)

    # A re-run rewrites none of the demo's files, so every latent comes from the cache.
    def vae_cache_line() -> str:
        return [line for line in (out / "training.log").read_text().splitlines() if "vae cache:" in line][-1]

    assert "vae cache: 24 items, 0 hits, 24 computed" in vae_cache_line()
    data = tmp_path / "demo" / "data"
    mtimes = {p.name: p.stat().st_mtime_ns for p in data.iterdir()}
    assert main(["demo", "--dir", str(tmp_path / "demo"), "--steps", "4"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in data.iterdir()} == mtimes
    assert "vae cache: 24 items, 24 hits, 0 computed" in vae_cache_line()


def test_cache_verify_and_clear_through_the_cli(tmp_path, capsys, make_config):
    raw = make_config(max_train_steps=1)
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(raw))
    assert main(["train", "--config", str(path)]) == 0
    capsys.readouterr()
    assert main(["cache", "verify", "--config", str(path), "--json"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert report  # one report per cache, with entries present
    assert main(["cache", "clear", "--config", str(path), "--yes"]) == 0
    assert not any((tmp_path / "cache").rglob("*.safetensors"))
