"""Conditioning images generated from a dataset's own images (`conditioning: {type: canny}`, SimpleTuner's dataset
`conditioning` block): one per image in the dataset's generated folder, in the image's format, paired as a
`conditioning_data_dir` is; made once, again for what changed; never over files it did not make; any dataset type."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from simpletuner.configuration import ConfigError, validate_config
from simpletuner.data_backend import build_datasets
from simpletuner.data_backend.canny import canny_image

CANNY = {"type": "canny"}


@pytest.fixture
def images(tmp_path):
    """Four 64 px shape images (three PNG, one JPEG) with captions, in a folder of this test's own."""
    from simpletuner.testing.demo_data import write_shapes_dataset

    folder = write_shapes_dataset(tmp_path / "images", num_images=4, sizes=((64, 64),))
    first = sorted(folder.glob("*.png"))[0]
    Image.open(first).convert("RGB").save(first.with_suffix(".jpg"), quality=95)
    first.unlink()
    return folder


def _build(make_config, images, tmp_path, **dataset):
    entry = {"id": "shapes", "type": "local", "instance_data_dir": str(images), "conditioning": CANNY, **dataset}
    config = validate_config(make_config(datasets=[entry]))
    (built,) = build_datasets(config)
    return built


def _folder(tmp_path, dataset_id="shapes"):
    return tmp_path / "cache" / "conditioning_data" / f"{dataset_id}_conditioning_canny"


def _mtimes(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if not p.name.startswith(".")}


def test_each_image_gets_its_edge_map_in_its_format(make_config, images, tmp_path):
    dataset = _build(make_config, images, tmp_path)
    folder = _folder(tmp_path)
    assert len(dataset.samples) == 4
    for sample in dataset.samples:
        source = folder / sample.path
        assert sample.source == str(source)
        original = Image.open(images / sample.path).convert("RGB")
        with Image.open(source) as made:
            assert made.format == ("JPEG" if sample.path.endswith(".jpg") else "PNG")
            if made.format == "PNG":  # lossless: the edge map itself
                assert made.convert("RGB").tobytes() == canny_image(original).tobytes()
            else:  # as SimpleTuner writes a JPEG image's map: PIL's default JPEG encoding of it
                encoded = io.BytesIO()
                canny_image(original).save(encoded, format="JPEG")
                assert source.read_bytes() == encoded.getvalue()


def _made(caplog, build) -> str:
    """The generation line ``build()`` logs ("" when it generated nothing)."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="simpletuner.data_backend.generated_conditioning"):
        build()
    return "\n".join(r.getMessage() for r in caplog.records if "generated" in r.getMessage())


def test_a_second_start_makes_nothing_and_only_what_changed_is_made_again(make_config, images, tmp_path, caplog):
    def build(**dataset):
        return _build(make_config, images, tmp_path, **dataset)

    folder = _folder(tmp_path)
    assert "generated 4 canny conditioning image(s)" in _made(caplog, build)
    first = _mtimes(folder)
    assert _made(caplog, build) == "" and _mtimes(folder) == first
    changed, removed = sorted(images.glob("*.png"))[:2]
    Image.new("RGB", (64, 64), (250, 250, 250)).save(changed)
    os.utime(changed, ns=(1, 1))  # another size and time: the image's identity changed
    removed.unlink()
    removed.with_suffix(".txt").unlink()
    assert "generated 1 canny conditioning image(s)" in _made(caplog, build)
    assert set(_mtimes(folder)) == set(first) - {removed.name}
    assert not Image.open(folder / changed.name).getbbox()  # a blank image has no edges
    # other thresholds: every map is made again
    thresholds = {"type": "canny", "low_threshold": 10, "high_threshold": 20}
    assert "generated 3 canny conditioning image(s)" in _made(caplog, lambda: build(conditioning=thresholds))
    manifest = json.loads((folder / ".generated.json").read_text())
    assert manifest["settings"]["low_threshold"] == 10 and len(manifest["files"]) == 3


def test_files_it_did_not_make_are_never_overwritten(make_config, images, tmp_path):
    mine = tmp_path / "my-edges"
    mine.mkdir()
    theirs = shutil.copy(next(images.glob("*.png")), mine)
    before = open(theirs, "rb").read()
    with pytest.raises(ValueError, match="holds images this trainer did not generate") as caught:
        _build(make_config, images, tmp_path, conditioning={**CANNY, "instance_data_dir": str(mine)})
    assert "conditioning.instance_data_dir" in str(caught.value)
    assert [p.name for p in mine.iterdir() if not p.name.startswith(".")] == [os.path.basename(theirs)]
    assert open(theirs, "rb").read() == before


def test_an_unreadable_image_is_a_bad_file_and_the_others_pair(make_config, images, tmp_path):
    (images / "broken.png").write_bytes(b"\x89PNG not really")
    dataset = _build(make_config, images, tmp_path)
    assert len(dataset.samples) == 4
    assert [path for path, _ in dataset.metadata.bad_files] == ["broken.png"]
    assert not (_folder(tmp_path) / "broken.png").exists()


def test_a_parquet_dataset_gets_a_map_for_each_row(make_config, tmp_path):
    rows = []
    for i in range(3):
        buffer = io.BytesIO()
        Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(buffer, format="PNG")
        rows.append({"bytes": buffer.getvalue(), "path": f"row{i}.png"})
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    folder = tmp_path / "pq" / "data"
    folder.mkdir(parents=True)
    table = pa.table({"image": pa.array(rows, type=kind), "text": ["a", "b", "c"]})
    pq.write_table(table, folder / "train-00000-of-00001.parquet")
    entry = {
        "id": "rows",
        "type": "parquet",
        "instance_data_dir": str(tmp_path / "pq"),
        "conditioning": CANNY,
    }
    (dataset,) = build_datasets(validate_config(make_config(datasets=[entry])))
    made = _folder(tmp_path, "rows")
    assert sorted(s.source for s in dataset.samples) == [
        str(made / "data" / "train-00000-of-00001.parquet" / f"row{i}.png") for i in range(3)
    ]


@pytest.mark.parametrize(
    "dataset, words",
    [
        ({"conditioning_data_dir": "/tmp"}, "keep one of the two"),
        ({"conditioning": {"type": "canny", "low_threshold": 90, "high_threshold": 20}}, "swap them"),
        ({"conditioning": {"type": "depth"}}, "canny"),
        ({"conditioning": {"type": "canny", "low_threshold": 0}}, "must be > 0"),
    ],
)
def test_settings_that_cannot_work_are_refused(make_config, images, dataset, words):
    entry = {"id": "shapes", "type": "local", "instance_data_dir": str(images), "conditioning": CANNY, **dataset}
    with pytest.raises(ConfigError, match=words):
        validate_config(make_config(datasets=[entry]))
