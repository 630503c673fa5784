"""Datasets kept in shard files (``type: webdataset`` tar shards, ``type: parquet`` files): real shards
written here with tarfile and pyarrow hold tiny PNG/JPEG images and captions. The backends list and read
them in place (the bytes read are the bytes written, nothing is written to disk), read a Parquet row
group once when read in order, train end to end with their captions reaching the text cache, and refuse
bad shards before training, naming the file."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from training_helpers import train

from simpletuner.caching import ShardedTensorStore
from simpletuner.configuration import validate_config
from simpletuner.data_backend.base import DataBackend, SupportsReadHead, SupportsShards
from simpletuner.data_backend.metadata import build_metadata
from simpletuner.data_backend.parquet_shards import ParquetBackend
from simpletuner.data_backend.shards import WebDatasetBackend

HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _image(index: int, fmt: str) -> bytes:
    """A small image of its own colour and size (so every file's bytes differ)."""
    out = io.BytesIO()
    Image.new("RGB", (64 + 16 * (index % 2), 64), (40 * index % 256, 90, 200 - 10 * index)).save(out, fmt)
    return out.getvalue()


def _write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def wds(tmp_path_factory):
    """Two shards (one in a sub-folder): ``(root, {virtual path: bytes}, {image path: caption})``. Besides
    images and ``.txt`` captions they hold a ``.caption`` caption, a ``.json`` member, a compound-field image
    (``seg.png``) and a hidden macOS ``._`` member: none of these last three is a training image."""
    root = tmp_path_factory.mktemp("wds")
    files, captions = {}, {}
    for shard, first in (("shard-000.tar", 0), ("more/shard-001.tar", 3)):
        members = []
        for index in range(first, first + 3):
            ext, fmt = (".png", "PNG") if index % 2 else (".jpg", "JPEG")
            image, caption = _image(index, fmt), f"a photo number {index}"
            field = "caption" if index == 4 else "txt"
            members += [
                (f"{index:04d}{ext}", image),
                (f"{index:04d}.{field}", caption.encode()),
                (f"{index:04d}.json", b"{}"),
            ]
            files[f"{shard}/{index:04d}{ext}"] = image
            files[f"{shard}/{index:04d}.txt"] = caption.encode()
            captions[f"{shard}/{index:04d}{ext}"] = caption
        members += [("0000.seg.png", _image(9, "PNG")), ("._0000.jpg", b"AppleDouble")]
        _write_tar(root / shard, members)
    return root, files, captions


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory):
    """Two datasets under one folder: ``hub``, a Hugging Face layout file (Image struct; rows 1 and 3 carry a
    `path`, the others none; 2 rows a row group) and ``plain``, plain binary with `name` and `caption` columns.
    Returns ``(folder of both, {"hub": (root, files, captions), "plain": ...})``."""
    folder = tmp_path_factory.mktemp("pq")
    hub, plain = folder / "hub", folder / "plain"
    files, captions = {}, {}
    images = [_image(i, "PNG" if i % 2 else "JPEG") for i in range(5)]
    texts = [f"row {i} of the hub file" for i in range(5)]
    paths = [None, "cat.png", None, "sub/dog.png", None]
    table = pa.table(
        {"image": pa.array([{"bytes": b, "path": p} for b, p in zip(images, paths)], type=HF_IMAGE), "text": texts}
    )
    (hub / "data").mkdir(parents=True)
    pq.write_table(table, hub / "data" / "train-00000-of-00001.parquet", row_group_size=2)
    shard = "data/train-00000-of-00001.parquet"
    for i, name in enumerate(["000000.jpg", "cat.png", "000002.jpg", "dog.png", "000004.jpg"]):
        files[f"{shard}/{name}"] = images[i]
        files[f"{shard}/{name[:-4]}.txt"] = texts[i].encode()
        captions[f"{shard}/{name}"] = texts[i]
    datasets = {"hub": (hub, files, captions)}
    files, captions = {}, {}
    plain_images = [_image(10 + i, "PNG") for i in range(3)]
    names = ["red.png", "blue.png", "dir/red.png"]  # the third's stem is taken: it becomes 000002-red.png
    table = pa.table({"name": names, "jpg": plain_images, "caption": [f"plain {n}" for n in names]})
    plain.mkdir()
    pq.write_table(table, plain / "part-0.parquet", row_group_size=2)
    for name, listed, data in zip(names, ["red.png", "blue.png", "000002-red.png"], plain_images):
        files[f"part-0.parquet/{listed}"] = data
        files[f"part-0.parquet/{listed[:-4]}.txt"] = f"plain {name}".encode()
        captions[f"part-0.parquet/{listed}"] = f"plain {name}"
    datasets["plain"] = (plain, files, captions)
    return folder, datasets


def _plain_backend(root: Path, **kwargs) -> ParquetBackend:
    return ParquetBackend(root, "plain", image_column="jpg", caption_column="caption", filename_column="name", **kwargs)


def _check_conformance(backend, files: dict[str, bytes], shard_of) -> None:
    assert isinstance(backend, DataBackend) and isinstance(backend, SupportsReadHead)
    assert isinstance(backend, SupportsShards)
    listed = backend.list_files()
    assert sorted(listed) == sorted(files)
    shards = [shard_of(p) for p in listed]
    assert shards == sorted(shards), "shard-major: one shard's files together, shards in sorted order"
    for path, data in files.items():
        assert backend.exists(path)
        assert backend.read(path) == data
        assert backend.read_head(path, 10) == data[:10]
        assert backend.size(path) == len(data)
        assert backend.shard_of(path) == shard_of(path)
    assert not backend.exists("nothing.png")
    with pytest.raises(FileNotFoundError, match="nothing.png"):
        backend.read("nothing.png")
    images = backend.list_files({".jpg", ".png"})
    assert images == [p for p in listed if p.endswith((".jpg", ".png"))]


def test_webdataset_backend_lists_and_reads_members_in_place(wds):
    root, files, _ = wds
    backend = WebDatasetBackend(root, "wds")
    _check_conformance(backend, files, lambda p: p.rsplit("/", 1)[0])
    assert backend.list_files()[:2] == ["more/shard-001.tar/0003.png", "more/shard-001.tar/0003.txt"]


@pytest.mark.parametrize("which", ["hub", "plain"])
def test_parquet_backend_names_rows_and_reads_them(parquet_dir, which):
    root, files, _ = parquet_dir[1][which]
    backend = ParquetBackend(root, "hub") if which == "hub" else _plain_backend(root)
    _check_conformance(backend, files, lambda p: p.split(".parquet/")[0] + ".parquet")


@pytest.mark.parametrize("which", ["hub", "plain"])
def test_parquet_row_groups_are_read_once_in_order(parquet_dir, monkeypatch, which):
    root = parquet_dir[1][which][0]
    backend = ParquetBackend(root, "hub", row_group_cache_size=1) if which == "hub" else _plain_backend(root)
    loads = []
    real = backend._load_row_group
    monkeypatch.setattr(backend, "_load_row_group", lambda *args, **kw: loads.append(args[:2]) or real(*args, **kw))
    for path in backend.list_files():
        backend.read(path)
    (shard,) = root.rglob("*.parquet")
    num_groups = pq.ParquetFile(shard).metadata.num_row_groups
    assert num_groups > 1
    assert loads == [(0, group) for group in range(num_groups)]


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_reading_writes_nothing(wds, parquet_dir, tmp_path, monkeypatch):
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    before = {root: _listing(root) for root in (wds[0], parquet_dir[0])}
    for backend in (
        WebDatasetBackend(wds[0], "w"),
        ParquetBackend(parquet_dir[1]["hub"][0], "p"),
        _plain_backend(parquet_dir[1]["plain"][0]),
    ):
        for path in backend.list_files():
            backend.read(path)
            backend.identity(path)
    assert {root: _listing(root) for root in before} == before
    assert not list(private_tmp.iterdir())


def test_identity_changes_when_a_shard_is_rewritten(tmp_path):
    _write_tar(tmp_path / "w" / "a.tar", [("0000.png", _image(1, "PNG")), ("0000.txt", b"one")])
    pq.write_table(pa.table({"image": [_image(2, "PNG")], "text": ["two"]}), tmp_path / "p.parquet")
    (tmp_path / "p").mkdir()
    os.replace(tmp_path / "p.parquet", tmp_path / "p" / "p.parquet")
    tar, parquet = WebDatasetBackend(tmp_path / "w", "w"), ParquetBackend(tmp_path / "p", "p", image_column="image")
    cases = [
        (tar, "a.tar/0000.png", tmp_path / "w" / "a.tar"),
        (parquet, "p.parquet/000000.png", tmp_path / "p" / "p.parquet"),
    ]
    before = {path: backend.identity(path) for backend, path, _ in cases}
    _write_tar(tmp_path / "w" / "a.tar", [("0000.png", _image(3, "PNG")), ("0000.txt", b"three")])
    pq.write_table(pa.table({"image": [_image(4, "PNG")], "text": ["four"]}), tmp_path / "p" / "p.parquet")
    for backend, path, shard in cases:
        os.utime(shard, ns=(1, 10**18))  # a new mtime even on a coarse clock
        assert backend.identity(path) != before[path]
        with pytest.raises(OSError, match="changed after it was indexed"):
            backend.read(path)
    assert WebDatasetBackend(tmp_path / "w", "w").read("a.tar/0000.png") == _image(3, "PNG")
    assert ParquetBackend(tmp_path / "p", "p").read("p.parquet/000000.png") == _image(4, "PNG")


def test_training_from_webdataset_shards(wds, make_config, tmp_path):
    root, _, captions = wds
    raw = make_config(
        max_train_steps=2, datasets=[{"id": "shards", "type": "webdataset", "instance_data_dir": str(root)}]
    )
    trainer, _ = train(raw)
    _check_captions(trainer, tmp_path, captions)


def test_training_from_parquet_files(parquet_dir, make_config, tmp_path):
    folder, datasets = parquet_dir
    raw = make_config(max_train_steps=2, datasets=[{"id": "hub", "type": "parquet", "instance_data_dir": str(folder)}])
    # The plain file has no `image` / `text` column: refused before training, naming it and its columns.
    with pytest.raises(ValueError, match=r"part-0\.parquet has no column 'image' \(`image_column`\).*'name', 'jpg'"):
        train(raw)
    root, _, captions = datasets["hub"]
    raw["datasets"][0]["instance_data_dir"] = str(root)
    trainer, _ = train(raw)
    _check_captions(trainer, tmp_path, captions)


def _check_captions(trainer, tmp_path: Path, captions: dict[str, str]) -> None:
    (dataset,) = trainer.state.datasets
    assert {s.path: s.caption for s in dataset.metadata.samples} == captions
    assert dataset.metadata.caption_sources == {"textfile": len(captions)}
    text_keys = trainer.data.text_keys
    assert set(captions.values()) <= set(text_keys)
    stored = set(ShardedTensorStore(tmp_path / "cache" / "sd" / "text").keys())
    assert {text_keys[c] for c in captions.values()} <= stored


# --- bad input: refused before training, naming the file ------------------------------------------------------------
def test_bad_tar_shards_are_refused_naming_the_file(tmp_path):
    good = io.BytesIO()
    with tarfile.open(fileobj=good, mode="w") as archive:
        for index in range(3):
            data = _image(index, "PNG")
            info = tarfile.TarInfo(f"{index:04d}.png")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    raw = good.getvalue()
    first_end = 512 + -(-len(_image(0, "PNG")) // 512) * 512  # the second member's header starts here
    cases = {
        "text.tar": (b"just some text, not a tar archive\n" * 40, "is not a readable tar file"),
        "empty.tar": (b"", "is not a readable tar file"),
        "cut-in-data.tar": (raw[: first_end + 700], "is cut off"),
        "cut-at-header.tar": (raw[:first_end], "cut off after 1 member"),
        "cut-in-header.tar": (raw[: first_end + 100], "cut off after 1 member"),
        "joined.tar": (raw + raw, "data after its end-of-archive marker"),
        "gzipped.tar": (__import__("gzip").compress(raw), "gzip-compressed"),
    }
    for name, (content, message) in cases.items():
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_bytes(content)
        with pytest.raises(ValueError, match=message) as error:
            WebDatasetBackend(folder, "bad")
        assert str(folder / name) in str(error.value)


def test_a_folder_without_shards_is_refused(tmp_path):
    (tmp_path / "a.tar.gz").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"no \.tar files under .*decompress them"):
        WebDatasetBackend(tmp_path, "none")
    with pytest.raises(ValueError, match=r"no \.parquet files under"):
        ParquetBackend(tmp_path, "none")


def test_bad_parquet_files_are_refused_naming_the_file(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "a.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(ValueError, match=r"a\.parquet is not a readable Parquet file"):
        ParquetBackend(tmp_path / "x", "bad")
    (tmp_path / "y").mkdir()
    pq.write_table(pa.table({"img": [_image(0, "PNG")], "caption": ["c"]}), tmp_path / "y" / "b.parquet")
    with pytest.raises(
        ValueError, match=r"b\.parquet has no column 'image' \(`image_column`\) or 'text' .*'img', 'caption'"
    ):
        ParquetBackend(tmp_path / "y", "bad")
    with pytest.raises(ValueError, match=r"column 'caption' \(`image_column`\) is string"):
        ParquetBackend(tmp_path / "y", "bad", image_column="caption", caption_column=None)


def test_a_row_without_image_bytes_counts_as_a_bad_file(tmp_path, make_config):
    rows = [{"bytes": _image(i, "PNG"), "path": None} for i in range(4)] + [{"bytes": None, "path": "lost.png"}]
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(
        pa.table({"image": pa.array(rows, type=HF_IMAGE), "text": [f"c{i}" for i in range(5)]}), data / "a.parquet"
    )
    backend = ParquetBackend(data, "nulls")
    raw = make_config(datasets=[{"id": "nulls", "type": "parquet", "instance_data_dir": str(data)}])
    config = validate_config({**raw, "max_bad_image_fraction": 0.25})
    metadata = build_metadata(backend, config.datasets[0], config, seed=0)
    assert len(metadata.samples) == 4
    assert [path for path, _ in metadata.bad_files] == ["a.parquet/lost.png"]
    assert "row 4" in metadata.bad_files[0][1] and "null" in metadata.bad_files[0][1]
    strict = validate_config({**raw, "max_bad_image_fraction": 0.1})
    with pytest.raises(ValueError, match=r"(?s)1 of 5 image files .* a\.parquet/lost\.png: .*row 4"):
        build_metadata(backend, strict.datasets[0], strict, seed=0)


@pytest.mark.parametrize("kind", ["webdataset", "parquet"])
def test_config_refuses_what_shards_cannot_do(make_config, tmp_path, kind):
    (tmp_path / "data").mkdir()
    entry = {"id": "s", "type": kind, "instance_data_dir": str(tmp_path / "data")}
    for extra, message in [
        ({"dataset_type": "video", "num_frames": 5}, "cannot read clips from `type: " + kind),
        ({"conditioning_data_dir": str(tmp_path)}, "conditioning_data_dir` \\(edit pairs\\)"),
    ]:
        with pytest.raises(Exception, match=message):
            validate_config(make_config(datasets=[{**entry, **extra}]))
    assert validate_config(make_config(datasets=[entry])).datasets[0].type == kind
