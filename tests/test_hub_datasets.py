"""``type: huggingface`` datasets: a Hub dataset's split, fetched by the real huggingface_hub client into a Hub cache
laid out as the client lays one out (offline) or served by a local Hub on 127.0.0.1 (online), trains as a Parquet
dataset; every way it cannot be had or read is one line naming the repo and the fix."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hub_fixtures import lay_out_hub_cache, repo_folder
from training_helpers import train

from simpletuner.configuration import ConfigError, validate_config
from simpletuner.data_backend.hub_dataset import (
    HubDatasetError,
    build_huggingface_backend,
    check_hub_datasets,
    fetch_split,
)
from simpletuner.data_backend.hub_splits import parquet_splits, split_parquet_files

REPO = "shapes-org/shapes"
HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _parquet(rows: list[tuple[str, bytes, str]], image="image", caption="text") -> bytes:
    """A Parquet file as ``datasets`` writes an image dataset: the Image struct ``{bytes, path}`` and a caption."""
    table = pa.table(
        {
            image: pa.array([{"bytes": data, "path": name} for name, data, _ in rows], type=HF_IMAGE),
            caption: [text for _, _, text in rows],
        }
    )
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


@pytest.fixture(scope="module")
def shapes_rows(shapes_dir) -> list[tuple[str, bytes, str]]:
    """``(file name, PNG bytes, caption)`` of the shapes dataset's images."""
    return [
        (p.name, p.read_bytes(), p.with_suffix(".txt").read_text().strip()) for p in sorted(shapes_dir.glob("*.png"))
    ]


@pytest.fixture(scope="module")
def repo_files(shapes_rows) -> dict[str, bytes]:
    """The repo as ``push_to_hub`` leaves it: a README, two train shards and a test shard."""
    train, test = shapes_rows[:8], shapes_rows[8:]
    return {
        "README.md": b"---\nlicense: mit\n---\n# shapes\n",
        ".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n",
        "data/train-00000-of-00002.parquet": _parquet(train[:4]),
        "data/train-00001-of-00002.parquet": _parquet(train[4:]),
        "data/test-00000-of-00001.parquet": _parquet(test),
    }


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache as this process's (HF_HUB_CACHE, read at each fetch), offline."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _entry(**keys) -> dict:
    return {"id": "shapes", "type": "huggingface", "dataset_name": REPO, **keys}


def _dataset_cfg(make_config, **keys):
    return validate_config(make_config(datasets=[_entry(**keys)])).datasets[0]


# --- which files are a split ----------------------------------------------------------------------------------------
LAYOUTS = [
    (  # push_to_hub: data/<split>-NNNNN-of-NNNNN.parquet, any split name
        ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", "data/extra-00000-of-00001.parquet"],
        {"train": ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]},
        ["train", "extra"],
    ),
    (  # the Hub's Parquet conversion (refs/convert/parquet): <config>/<split>/NNNN.parquet
        ["default/train/0000.parquet", "default/partial-validation/0000.parquet", "default/test/0000.parquet"],
        {"train": ["default/train/0000.parquet"], "validation": ["default/partial-validation/0000.parquet"]},
        ["train", "validation", "test"],
    ),
    (  # the split in the file name; `pretraining` is not `train`
        ["train.parquet", "my_valid_file.parquet", "pretraining.parquet"],
        {"train": ["train.parquet"], "validation": ["my_valid_file.parquet"]},
        ["train", "validation"],
    ),
    (  # no split named: every data file is train; README, hidden files and __ folders are not data
        ["images.parquet", "more/part-1.parquet", "README.md", ".hidden/x.parquet", "__pycache__/y.parquet"],
        {"train": ["images.parquet", "more/part-1.parquet"], "test": []},
        ["train"],
    ),
    (["train/0001.jpg", "train/metadata.csv"], {"train": []}, []),  # an image folder: no Parquet files
]


@pytest.mark.parametrize("paths,files,splits", LAYOUTS)
def test_a_splits_files_are_named_as_the_datasets_library_names_them(paths, files, splits):
    for split, expected in files.items():
        assert split_parquet_files(paths, split) == expected
    assert parquet_splits(paths) == splits


# --- offline: the Hub cache ------------------------------------------------------------------------------------------
def test_a_hub_dataset_trains_one_step_from_the_hub_cache_offline(
    make_config, hub_cache, repo_files, shapes_rows, caplog
):
    commit = lay_out_hub_cache(hub_cache, REPO, repo_files, repo_type="dataset")
    raw = make_config(max_train_steps=1, datasets=[_entry()])
    with caplog.at_level(logging.INFO, logger="simpletuner"):
        trainer, result = train(raw)
    assert trainer.progress.global_step == 1
    (dataset,) = trainer.state.datasets
    captions = {s.path: s.caption for s in dataset.metadata.samples}
    expected = {
        f"data/train-0000{i // 4}-of-00002.parquet/{name}": text for i, (name, _, text) in enumerate(shapes_rows[:8])
    }
    assert captions == expected  # the train split only, each row's caption from the `text` column
    snapshot = repo_folder(hub_cache, REPO, "dataset") / "snapshots" / commit
    assert f"Hub dataset {REPO}@main (commit {commit[:12]}), split train: 2 Parquet file(s)" in caplog.text
    assert str(snapshot) in caplog.text


def test_the_backend_reads_the_split_in_place(make_config, hub_cache, repo_files, shapes_rows):
    lay_out_hub_cache(hub_cache, REPO, repo_files, repo_type="dataset")
    cfg = _dataset_cfg(make_config, split="test", caption_column="text")
    backend = build_huggingface_backend(cfg, None)
    name, data, text = shapes_rows[8]
    shard = "data/test-00000-of-00001.parquet"
    assert backend.list_files({".png"}) == [f"{shard}/{n}" for n, _, _ in shapes_rows[8:]]
    assert backend.read(f"{shard}/{name}") == data
    assert backend.read(f"{shard}/{Path(name).stem}.txt").decode() == text


def test_the_config_names_the_repo_not_a_folder(make_config):
    cfg = _dataset_cfg(make_config, revision="refs/convert/parquet")
    assert (cfg.split, cfg.image_column, cfg.caption_column) == ("train", "image", "text")
    assert cfg.instance_data_dir == f"hf://datasets/{REPO}@refs%2Fconvert%2Fparquet"
    for keys, message in [
        ({"instance_data_dir": "/data"}, "`instance_data_dir` is not set for `type: huggingface`"),
        ({"dataset_name": "https://huggingface.co/datasets/org/name"}, "give the repo id alone, `org/name`"),
        ({"dataset_name": "./parquet"}, "use `type: parquet` with `instance_data_dir`"),
        ({"dataset_name": "org--x/name"}, "is not a Hub repo id"),
        ({"split": "train[:10%]"}, "slices such as `train[:10%]` are not supported"),
        ({"dataset_type": "video", "num_frames": 5}, "cannot read clips from `type: huggingface`"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
            validate_config(make_config(datasets=[_entry(**keys)]))


# --- bad input: one line naming the repo and the fix ----------------------------------------------------------------
def _fails(match: str, repo: str = REPO, **keys) -> str:
    with pytest.raises(HubDatasetError) as info:
        fetch_split(repo, **keys)
    message = str(info.value)
    assert "\n" not in message and repo in message
    assert re.search(match, message), message
    return message


def test_offline_with_nothing_cached_says_how_to_fill_the_cache(hub_cache):
    message = _fails(r"is not in the Hub cache .* and HF_HUB_OFFLINE is set")
    assert f"(`hf download {REPO} --repo-type dataset`) and copy it here" in message and str(hub_cache) in message
    message = _fails(r"not in the Hub cache", revision="v2")
    assert f"`hf download {REPO} --repo-type dataset --revision v2`" in message


def test_offline_with_part_of_the_split_cached_names_what_to_fetch(hub_cache, repo_files):
    commit = lay_out_hub_cache(hub_cache, REPO, repo_files, repo_type="dataset")
    snapshot = repo_folder(hub_cache, REPO, "dataset") / "snapshots" / commit
    (snapshot / "data" / "train-00001-of-00002.parquet").unlink()  # an interrupted download
    _fails(r"holds only part of split 'train' .* HF_HUB_OFFLINE is set: fill a cache on a machine with network \(`hf")
    assert fetch_split(REPO, split="test").files == ("data/test-00000-of-00001.parquet",)  # the test split is whole


def test_a_cache_without_a_tree_listing_reads_what_is_on_disk(hub_cache, repo_files):
    lay_out_hub_cache(hub_cache, REPO, repo_files, repo_type="dataset", tree_listing=False)
    assert fetch_split(REPO).files == ("data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet")
    _fails(
        r"the Hub cache .* holds no Parquet files of split 'validation' .* HF_HUB_OFFLINE is set", split="validation"
    )


def test_a_split_the_repo_does_not_have_lists_those_it_has(hub_cache, repo_files):
    lay_out_hub_cache(hub_cache, REPO, repo_files, repo_type="dataset")
    _fails(
        r"has no Parquet files for split 'validation'; its splits: train, test; set `split` to one of them",
        split="validation",
    )


def test_a_repo_without_parquet_files_points_at_the_hubs_conversion(hub_cache, shapes_rows):
    name, data, text = shapes_rows[0]
    lay_out_hub_cache(
        hub_cache,
        REPO,
        {f"train/{name}": data, "train/metadata.csv": f"file_name,text\n{name},{text}\n".encode()},
        repo_type="dataset",
    )
    _fails(r"has no Parquet files \(its data files are \.csv, \.png\): set `revision: refs/convert/parquet`")


@pytest.mark.parametrize(
    "keys,match",
    [
        ({"caption_column": "caption"}, r"no column 'caption' \(`caption_column`\); its columns are: 'image', 'text'"),
        ({"image_column": "img"}, r"no column 'img' \(`image_column`\); its columns are: 'image', 'text'"),
        ({"image_column": "text"}, r"column 'text' \(`image_column`\) is string, not encoded images"),
    ],
)
def test_a_column_the_files_lack_is_refused_listing_those_they_have(make_config, hub_cache, repo_files, keys, match):
    lay_out_hub_cache(hub_cache, REPO, repo_files, repo_type="dataset")
    config = validate_config(make_config(output_dir=str(hub_cache.parent / "out"), datasets=[_entry(**keys)]))
    (problem,) = check_hub_datasets(config)
    assert problem.startswith(f"datasets[0] (shapes): Hub dataset {REPO}@main (commit ")
    assert ": data/train-00000-of-00002.parquet has no column" in problem or "is string" in problem
    assert re.search(match, problem) and "\n" not in problem
    assert not (hub_cache.parent / "out").exists()  # the check writes nothing


def test_a_caption_column_is_not_needed_without_textfile_captions(make_config, hub_cache, repo_files):
    lay_out_hub_cache(hub_cache, REPO, repo_files, repo_type="dataset")
    entry = _entry(caption_column="caption", caption_strategy="instance_prompt", instance_prompt="a shape")
    assert check_hub_datasets(validate_config(make_config(datasets=[entry]))) == []


# --- online: the real client against a local Hub ----------------------------------------------------------------------
def test_online_only_the_splits_files_are_downloaded_then_found_offline(hub_server, repo_files, monkeypatch, caplog):
    commit = hub_server.add_repo(REPO, repo_files, repo_type="dataset")
    with caplog.at_level(logging.INFO, logger="simpletuner"):
        fetched = fetch_split(REPO)
    assert fetched.commit == commit and fetched.folder.name == commit
    assert fetched.folder.is_relative_to(hub_server.cache_dir)  # the Hub cache of HF_HUB_CACHE, never another
    on_disk = sorted(p.relative_to(fetched.folder).as_posix() for p in fetched.folder.rglob("*") if p.is_file())
    assert on_disk == ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]  # not test, no README
    for name in on_disk:
        assert (fetched.folder / name).read_bytes() == repo_files[name]
    assert f"Hub dataset {REPO}@main (commit {commit[:12]}), split train: 2 Parquet file(s)" in caplog.text
    assert not hub_server.unhandled
    # the refs and the tree listing are in the cache: offline, the same files are found without a request
    asked = len(hub_server.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert fetch_split(REPO) == fetched
    assert len(hub_server.requests) == asked


def test_online_a_tag_resolves_to_its_commit(hub_server, repo_files, shapes_rows):
    hub_server.add_repo(REPO, repo_files, repo_type="dataset")
    old = {"data/train-00000-of-00001.parquet": _parquet(shapes_rows[:2])}
    tagged = hub_server.add_repo(REPO, old, repo_type="dataset", revision="v1")
    fetched = fetch_split(REPO, revision="v1")
    assert (fetched.commit, fetched.files) == (tagged, ("data/train-00000-of-00001.parquet",))


def test_online_the_split_trains_one_step(hub_server, repo_files, make_config):
    hub_server.add_repo(REPO, repo_files, repo_type="dataset")
    raw = make_config(max_train_steps=1, datasets=[_entry(split="test")])
    assert check_hub_datasets(validate_config(raw)) == []
    trainer, _ = train(raw)
    (dataset,) = trainer.state.datasets
    assert {s.path.split("/")[1] for s in dataset.metadata.samples} == {"test-00000-of-00001.parquet"}


@pytest.mark.parametrize(
    "repo,keys,match",
    [
        (
            "shapes-org/shapez",
            {},
            r"no such dataset repo on the Hub at http://127\.0\.0\.1:\d+, or it is private and "
            r"no token is set: check `dataset_name`",
        ),
        (
            "shapes-org/private",
            {},
            r"or it is private and no token is set: .*log in \(`hf auth login`, or set HF_TOKEN\)",
        ),
        (
            "shapes-org/gated",
            {},
            r"is gated on the Hub at .*: accept its conditions on the dataset's page \(http://127"
            r".*/datasets/shapes-org/gated\), then log in on this machine \(`hf auth login`, or set HF_TOKEN",
        ),
        (REPO, {"revision": "v9"}, r"revision 'v9' does not exist on the Hub at .*: set `revision` to a branch, tag"),
    ],
)
def test_online_a_repo_that_cannot_be_had_is_one_line(hub_server, repo_files, repo, keys, match):
    hub_server.add_repo(REPO, repo_files, repo_type="dataset")
    hub_server.add_repo("shapes-org/private", repo_files, repo_type="dataset", private=True)
    hub_server.add_repo("shapes-org/gated", repo_files, repo_type="dataset", gated=True)
    _fails(match, repo, **keys)
    assert not list(hub_server.cache_dir.glob("datasets--*/snapshots/*/*"))  # nothing fetched


def test_online_a_private_repo_downloads_with_a_token(hub_server, repo_files, monkeypatch):
    hub_server.add_repo("shapes-org/private", repo_files, repo_type="dataset", private=True)
    monkeypatch.setenv("HF_TOKEN", hub_server.token)
    assert len(fetch_split("shapes-org/private").files) == 2


def test_online_a_hub_that_cannot_be_reached_and_an_empty_cache(hub_server, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    _fails(
        r"the Hub at http://127\.0\.0\.1:9 cannot be reached and the Hub cache .* does not hold it: check the "
        r"network \(and HF_ENDPOINT\)"
    )


# --- SimpleTuner's dialect --------------------------------------------------------------------------------------------
def _simpletuner_project(tmp_path, tiny_sd, shapes_dir, entry: dict) -> Path:
    from test_dialect import _project

    text = {"id": "text", "dataset_type": "text_embeds", "default": True, "type": "local", "cache_dir": "cache/text"}
    return _project(tmp_path, tiny_sd, shapes_dir, {"--max_train_steps": 1}, [entry, text])


def _translated(tmp_path, entry: dict):
    """(native config, report) of a SimpleTuner config whose one dataset is ``entry``."""
    from test_dialect_same_rows import write_project

    from simpletuner.configuration.simpletuner import translate as dialect

    raw = write_project(tmp_path, {})
    (tmp_path / "multidatabackend.json").write_text(json.dumps([entry]))
    return dialect.translate(raw, None, tmp_path)


def _one_shard_repo(hub_cache: Path, repo: str, rows, **columns) -> None:
    """``repo`` in the Hub cache as push_to_hub leaves a one-shard train split of ``rows``."""
    shard = _parquet(rows, **columns)
    lay_out_hub_cache(hub_cache, repo, {"data/train-00000-of-00001.parquet": shard}, repo_type="dataset")


def test_a_simpletuner_hub_dataset_trains_with_its_caption_column(
    tmp_path, tiny_sd, shapes_dir, hub_cache, shapes_rows, monkeypatch
):
    """An entry as SimpleTuner's published examples write one (the anima example's): captions from
    `huggingface.caption_column`, images from `image_column`; the entry's own `caption_column` is not read there."""
    from simpletuner.cli import main
    from simpletuner.configuration import load_config
    from simpletuner.data_backend import build_datasets

    rows = shapes_rows[:4]
    _one_shard_repo(hub_cache, "Dhiraj45/Anime-Caption", rows, image="Image", caption="Caption")
    entry = {
        "id": "anime-caption-hf-64",
        "type": "huggingface",
        "dataset_name": "Dhiraj45/Anime-Caption",
        "caption_strategy": "huggingface",
        "metadata_backend": "huggingface",
        "image_column": "Image",
        "caption_column": "Caption",
        "huggingface": {
            "caption_column": "Caption",
            "dataset_name": "Dhiraj45/Anime-Caption",
            "file_extension": "jpg",
            "image_column": "Image",
        },
        "resolution": 64,
        "resolution_type": "pixel_area",
        "crop": True,
        "crop_aspect": "square",
        "crop_style": "center",
    }
    path = _simpletuner_project(tmp_path, tiny_sd, shapes_dir, entry)
    monkeypatch.chdir(path.parent.parent)  # SimpleTuner's working directory
    (dataset,) = build_datasets(load_config(path).config)
    assert {s.caption for s in dataset.samples} == {text for _, _, text in rows}
    assert main(["train", "--config", str(path)]) == 0


@pytest.mark.parametrize(
    "keys,problem",
    [
        ({"caption_strategy": "textfile"}, "`caption_strategy: textfile` on a `type: huggingface` entry"),
        ({"caption_strategy": None}, "(where unset, the top-level value or SimpleTuner's default `filename`)"),
        ({"huggingface": {"caption_column": ["a", "b"]}}, "one caption column is read here"),
        ({"huggingface": {"caption_column": "meta.caption"}}, "a field inside a column is not read here"),
        ({"huggingface": {"filter_func": {"min_width": 512}}}, "rows cannot be filtered here"),
        ({"huggingface": {"composite_image_config": {"enabled": True}}}, "cutting one image out of a grid"),
        ({"huggingface": {"fallback_caption_column": "alt"}}, "one caption column is read here: fill the empty"),
        ({"huggingface": {"colour_column": "x"}}, "not a key SimpleTuner reads in the `huggingface` block"),
        ({"split_composite_images": True}, "cutting grid images into several samples is not supported"),
        ({"type": "local", "caption_strategy": "huggingface"}, "it needs `type: huggingface`, as in SimpleTuner"),
    ],
)
def test_what_simpletuners_hub_datasets_do_that_this_trainer_does_not_is_refused(tmp_path, keys, problem):
    from simpletuner.configuration.simpletuner.reading import DialectError

    entry = {"id": "d", "type": "huggingface", "dataset_name": "org/set", "caption_strategy": "huggingface", **keys}
    with pytest.raises(DialectError) as error:
        _translated(tmp_path, {k: v for k, v in entry.items() if v is not None})
    assert any(problem in line for line in error.value.problems), error.value.problems


def test_what_simpletuners_hub_datasets_set_that_changes_nothing_is_reported(tmp_path):
    entry = {
        "id": "d",
        "type": "huggingface",
        "instance_data_dir": "data",  # SimpleTuner gives a Hub dataset no folder
        "dataset_name": "org/set",
        "caption_strategy": "instanceprompt",
        "instance_prompt": "sks",
        "cache_dir": "cache/hf",
        "streaming": True,
        "huggingface": {"num_proc": 4, "width_column": "w", "video_column": "video", "streaming": True},
    }
    native, report = _translated(tmp_path, entry)
    validate_config(native, check_files=False)
    ignored = " ".join(report.ignored)
    for key in ("instance_data_dir", "cache_dir", "streaming", "huggingface.num_proc", "huggingface.streaming"):
        assert f"`datasets[0] (d).{key}`" in ignored, key
    assert "Hub cache (HF_HUB_CACHE / HF_HOME)" in ignored
    assert native["datasets"][0]["caption_strategy"] == "instance_prompt"


def test_simpletuners_published_dreambooth_entry_reads_its_hub_dataset_from_the_cache(
    tmp_path, tiny_sd, shapes_dir, hub_cache, monkeypatch
):
    """The first entry of SimpleTuner's simpletuner/examples/multidatabackend-small-dreambooth-512px.json, as
    published, over a stand-in RareConcepts/Domokun (push_to_hub's layout) in the Hub cache: every image trains
    at 512x512 with the instance prompt."""
    from PIL import Image

    from simpletuner.configuration import load_config
    from simpletuner.data_backend import build_datasets

    rows = []
    for i, size in enumerate([(640, 480), (300, 300), (200, 260)]):
        out = io.BytesIO()
        Image.new("RGB", size, (60 * i, 120, 200)).save(out, "PNG")
        rows.append((f"domo{i}.png", out.getvalue(), ""))
    _one_shard_repo(hub_cache, "RareConcepts/Domokun", rows)
    entry = {
        "id": "dreambooth-512",
        "type": "huggingface",
        "dataset_name": "RareConcepts/Domokun",
        "crop": True, "crop_style": "random", "crop_aspect": "square",
        "minimum_image_size": 128,
        "maximum_image_size": 512,
        "target_downsample_size": 512,
        "resolution": 512,
        "resolution_type": "pixel",
        "metadata_backend": "huggingface",
        "caption_strategy": "instanceprompt",
        "instance_prompt": "🟫",
        "cache_dir_vae": "cache/vae/{model_family}/dreambooth-512",
    }  # fmt: skip
    path = _simpletuner_project(tmp_path, tiny_sd, shapes_dir, entry)
    monkeypatch.chdir(path.parent.parent)
    (dataset,) = build_datasets(load_config(path).config)
    assert len(dataset.samples) == 3
    assert {s.bucket for s in dataset.samples} == {(512, 512)}
    assert {s.caption for s in dataset.samples} == {"🟫"}


def test_train_stops_on_a_hub_dataset_that_cannot_be_had_before_writing_output_dir(
    make_config, hub_cache, tmp_path, capsys
):
    """`simpletuner train` checks every Hub dataset before the run claims its output folder."""
    import json

    from simpletuner.cli.train import main as train_main

    out = tmp_path / "never-written"
    config = tmp_path / "hub-data.json"
    raw = make_config(max_train_steps=1, output_dir=str(out), datasets=[_entry(dataset_name="nobody/missing")])
    config.write_text(json.dumps(raw))
    assert train_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "nobody/missing" in err and "HF_HUB_OFFLINE" in err
    assert not out.exists()
