"""The `same` rows of SimpleTuner's dataset entries (multidatabackend.json), backed by figures from its code.

Layout and rules as in test_dialect_same_rows.py (which holds the table check over both files): each row
names SimpleTuner's lines, says what it does, and lists entry fragments with the native values the
translation must write; bucket sizes, size filters and repeats are checked as behaviours against figures
computed once by running SimpleTuner's own code (``TrainingSample.calculate_target_size`` with its
data-backend config and alignment, ``meets_resolution_requirements``) on the inputs named.
"""

from __future__ import annotations

import json

import pytest
from PIL import Image
from test_dialect_same_rows import UNSET, Row, _row, check_case, write_project

from simpletuner.configuration import validate_config
from simpletuner.configuration.simpletuner import translate as dialect
from simpletuner.data_backend import LocalDataBackend, build_metadata
from simpletuner.data_backend.geometry import geometry_for

H = "simpletuner/helpers/"
CFG = f"{H}data_backend/config/image.py"
GEOMETRY = "tests/test_dialect_same_rows_datasets.py::test_buckets_are_simpletuners"
_OTHER = {"id": "other", "type": "local", "instance_data_dir": "data"}  # an enabled entry beside a disabled one
_SOURCES = {  # a Qwen-Image-Edit source folder, paired with the entry under test
    "id": "sources",
    "type": "local",
    "dataset_type": "conditioning",
    "instance_data_dir": "src",
    "conditioning_type": "reference_strict",
}
_MASKS = {  # a mask folder (masked loss), paired with the entry under test
    "id": "masks",
    "type": "local",
    "dataset_type": "conditioning",
    "instance_data_dir": "masks",
    "conditioning_type": "mask",
}
_S3 = {"type": "aws", "aws_bucket_name": "b", "instance_data_dir": None}  # an `aws` entry (no local folder)
#: A `type: huggingface` entry (no local folder), as SimpleTuner's examples write one.
_HUB = {"type": "huggingface", "instance_data_dir": None, "dataset_name": "org/set", "caption_strategy": "huggingface"}
HF_CFG = f"{CFG}:167"  # SimpleTuner reads the `huggingface` keys for `type: huggingface` only
HF_LOAD = f"{H}data_backend/huggingface.py:117"  # datasets.load_dataset(dataset_name, split=, revision=)

DATASET_ROWS: dict[str, Row] = {
    "id": _row(f"{CFG}:109", "the dataset's name", ({"id": "photos"}, {"id": "photos"})),
    "type": _row(
        f"{CFG}:110 {H}data_backend/builders/__init__.py:27",
        "where files are read from: `local` a folder, `aws` an S3 bucket",
        ({"type": "local"}, {"type": "local"}),
        ({"type": "aws", "aws_bucket_name": "b", "instance_data_dir": None}, {"type": "object_store"}),
        (_HUB, {"type": "huggingface", "caption_column": "caption"}),
    ),
    "dataset_name": _row(
        f"{HF_CFG} {CFG}:170 {HF_LOAD}",
        "the Hub dataset's repo id, the entry's own before the `huggingface` block's",
        (_HUB, {"dataset_name": "org/set"}),
        ({**_HUB, "dataset_name": None, "huggingface": {"dataset_name": "org/other"}}, {"dataset_name": "org/other"}),
        ({**_HUB, "huggingface": {"dataset_name": "org/other"}}, {"dataset_name": "org/set"}),
        ({"dataset_name": "org/set"}, {"dataset_name": UNSET}),  # not read on a local entry
    ),
    "split": _row(
        f"{CFG}:171 {H}data_backend/huggingface.py:119",
        "the split loaded, `train` when unset",
        ({**_HUB, "split": "test"}, {"split": "test"}),
        ({**_HUB, "huggingface": {"split": "validation"}}, {"split": "validation"}),
        (_HUB, {"split": UNSET}),  # the native default is train
    ),
    "revision": _row(
        f"{CFG}:172 {H}data_backend/huggingface.py:120",
        "the branch, tag or commit loaded; null: the default branch",
        ({**_HUB, "revision": "v1.0"}, {"revision": "v1.0"}),
        (
            {**_HUB, "revision": None, "huggingface": {"revision": "refs/convert/parquet"}},
            {"revision": "refs/convert/parquet"},
        ),
        (_HUB, {"revision": UNSET}),  # the native default is main
    ),
    "image_column": _row(
        f"{CFG}:173 {H}data_backend/huggingface.py:522",
        "the column of images, `image` when unset",
        ({**_HUB, "image_column": "Image"}, {"image_column": "Image"}),
        ({**_HUB, "huggingface": {"image_column": "jpg"}}, {"image_column": "jpg"}),
    ),
    "huggingface": _row(
        f"{H}data_backend/factory.py:3102 {H}metadata/backends/huggingface.py:83 "
        f"{H}metadata/backends/huggingface.py:234",
        "its `caption_column` names the captions' column, `caption` when unset",
        (
            {**_HUB, "huggingface": {"caption_column": "Caption"}},
            {"caption_column": "Caption", "caption_strategy": "textfile"},
        ),
        ({**_HUB, "huggingface": {"caption_column": ["prompt"]}}, {"caption_column": "prompt"}),
        ({**_HUB, "caption_column": "text"}, {"caption_column": "caption"}),  # the entry's own key is not read
        also="tests/test_hub_datasets.py::test_a_simpletuner_hub_dataset_trains_with_its_caption_column",
    ),
    "instance_data_dir": _row(
        f"{H}data_backend/factory.py:2999 {H}data_backend/builders/local.py:45",
        "the image folder, from the working directory",
        ({"instance_data_dir": "data"}, {"instance_data_dir": "{cwd}/data"}),
    ),
    "aws_bucket_name": _row(
        f"{CFG}:156 {H}data_backend/builders/aws.py:40 {H}data_backend/aws.py:76",
        "the S3 bucket the files are in",
        ({"type": "aws", "aws_bucket_name": "b", "instance_data_dir": None}, {"instance_data_dir": "s3://b/"}),
    ),
    "aws_data_prefix": _row(
        f"{CFG}:118 {H}data_backend/factory.py:3011",
        "the folder inside the bucket (the backend's instance_data_dir)",
        (
            {"type": "aws", "aws_bucket_name": "b", "aws_data_prefix": "imgs/", "instance_data_dir": None},
            {"instance_data_dir": "s3://b/imgs"},
        ),
    ),
    "aws_endpoint_url": _row(
        f"{CFG}:158 {H}data_backend/aws.py:87",
        "boto3's endpoint_url",
        ({**_S3, "aws_endpoint_url": "https://s3.example"}, {"storage_options.endpoint_url": "https://s3.example"}),
    ),
    "aws_access_key_id": _row(
        f"{CFG}:159 {H}data_backend/aws.py:94",
        "boto3's aws_access_key_id",
        ({**_S3, "aws_access_key_id": "AK"}, {"storage_options.key": "AK"}),
    ),
    "aws_secret_access_key": _row(
        f"{CFG}:160 {H}data_backend/aws.py:95",
        "boto3's aws_secret_access_key",
        ({**_S3, "aws_secret_access_key": "SK"}, {"storage_options.secret": "SK"}),
    ),
    "aws_session_token": _row(
        f"{CFG}:161 {H}data_backend/aws.py:96",
        "boto3's aws_session_token",
        ({**_S3, "aws_session_token": "T"}, {"storage_options.token": "T"}),
    ),
    "dataset_type": _row(
        f"{CFG}:111 {H}data_backend/factory.py:2944",
        "image (default) or video samples",
        ({"dataset_type": "image"}, {"dataset_type": "image"}),
        ({"dataset_type": "video", "video": {"num_frames": 9}}, {"dataset_type": "video"}),
        family="wan",
    ),
    "disabled": _row(
        f"{CFG}:116 {H}data_backend/factory.py:1175",
        "true leaves the dataset out",
        ({"disabled": True, "__also__": [_OTHER]}, {"disabled": True}),
    ),
    "disable": _row(
        f"{CFG}:116 {H}data_backend/factory.py:1175",
        "SimpleTuner's other spelling of `disabled`",
        ({"disable": True, "__also__": [_OTHER]}, {"disabled": True}),
    ),
    "crop": _row(
        f"{CFG}:121 {H}image_manipulation/training_sample.py:600",
        "crop to the bucket (default false: the bucket keeps the image's aspect)",
        ({"crop": True}, {"crop": True}),
        ({}, {"crop": False}),
        also=GEOMETRY,
    ),
    "crop_style": _row(
        f"{CFG}:124 {H}image_manipulation/cropping.py:280",
        "where the crop window sits: random (default), center / centre, corner (top left)",
        ({"crop": True, "crop_style": "centre"}, {"crop_style": "center"}),
        ({"crop": True, "crop_style": "corner"}, {"crop_style": "corner"}),
        ({"crop": True}, {"crop_style": "random"}),
    ),
    "crop_aspect": _row(
        f"{CFG}:122 {H}image_manipulation/training_sample.py:601 {H}image_manipulation/training_sample.py:623",
        "square (default), preserve, closest or random bucket aspect",
        ({"crop": True, "crop_aspect": "preserve"}, {"crop_aspect": "preserve"}),
        ({"crop": True}, {"crop_aspect": "square"}),
        also=GEOMETRY,
    ),
    "crop_aspect_buckets": _row(
        f"{CFG}:123 {H}image_manipulation/training_sample.py:292 {H}image_manipulation/training_sample.py:320",
        "the aspects closest / random choose from",
        (
            {"crop": True, "crop_aspect": "closest", "crop_aspect_buckets": [0.75, 1.0, 1.5]},
            {"crop_aspect_buckets": [0.75, 1.0, 1.5]},
        ),
        also=GEOMETRY,
    ),
    "resolution": _row(
        f"{CFG}:136 {H}data_backend/factory.py:3566",
        "the dataset's size, in its resolution_type's unit",
        ({"resolution": 512}, {"resolution": 512}),
        also=GEOMETRY,
    ),
    "resolution_type": _row(
        f"{CFG}:137 {H}data_backend/factory.py:2962 {H}image_manipulation/training_sample.py:218",
        "pixel (shorter side), area (megapixels) or pixel_area (a side, as an area)",
        ({"resolution_type": "pixel"}, {"resolution_type": "pixel"}),
        ({"resolution_type": "area", "resolution": 1.0}, {"resolution_type": "area", "resolution": 1.0}),
        also=GEOMETRY,
    ),
    "minimum_image_size": _row(
        f"{CFG}:129 {H}metadata/backends/base.py:160 {H}metadata/backends/base.py:1256",
        "images below it are left out (pixel: both sides; area: the area; 0: none)",
        ({"resolution_type": "pixel", "minimum_image_size": 512}, {"minimum_image_size": 512}),
        ({"minimum_image_size": 0}, {"minimum_image_size": UNSET}),
        also="tests/test_dialect_same_rows_datasets.py::test_minimum_image_size_is_simpletuners",
    ),
    "caption_strategy": _row(
        f"{H}prompts.py:389 {H}prompts.py:409 {H}data_backend/factory.py:624",
        "captions from text files, the file name (its stem, `_` as a space), the instance prompt or a table",
        ({"caption_strategy": "filename"}, {"caption_strategy": "filename"}),
        ({"caption_strategy": "textfile"}, {"caption_strategy": "textfile"}),
        ({"caption_strategy": "instanceprompt", "instance_prompt": "sks"}, {"caption_strategy": "instance_prompt"}),
        also="tests/test_data_backend_metadata.py::test_caption_from_filename_is_simpletuners "
        "tests/test_caption_lines.py::test_a_caption_file_gives_simpletuners_lines",
    ),
    "disable_multiline_split": _row(
        f"{H}prompts.py:419 {H}multiaspect/sampler.py:739",
        "false: a caption file of several lines is several captions, one drawn per step; true: one caption",
        ({"disable_multiline_split": True}, {"disable_multiline_split": True}),
        ({"disable_multiline_split": "false"}, {"disable_multiline_split": False}),
        also="tests/test_caption_lines.py::test_a_caption_file_gives_simpletuners_lines "
        "tests/test_caption_lines.py::test_a_resumed_sampler_draws_the_same_lines",
    ),
    "instance_prompt": _row(
        f"{H}data_backend/factory.py:3506 {H}prompts.py:388",
        "the caption of instance-prompt datasets, and what prepend puts first",
        ({"instance_prompt": "sks dog"}, {"instance_prompt": "sks dog"}),
    ),
    "prepend_instance_prompt": _row(
        f"{H}data_backend/factory.py:3505 {H}prompts.py:393 {H}prompts.py:428",
        "caption = instance_prompt + ' ' + caption",
        ({"instance_prompt": "sks", "prepend_instance_prompt": True}, {"prepend_instance_prompt": True}),
        also="tests/test_captions_dialect.py::test_prepend_puts_the_instance_prompt_and_a_space_first",
    ),
    "caption_shuffle": _row(
        f"{H}data_backend/factory.py:697 {H}prompts.py:175 {H}prompts.py:240 {H}prompts.py:638 "
        f"{H}multiaspect/sampler.py:739",
        "each caption and count shuffled copies of its tags after position_start, copy i shuffled with "
        "random.Random(seed + md5(caption) + i), encoded once; each sample draws one",
        (
            {"caption_shuffle": {"enable": True, "count": 3, "position_start": 1, "seed": 4}},
            {"caption_shuffle": {"enable": True, "count": 3, "position_start": 1, "seed": 4}},
        ),
        ({"caption_shuffle": {"enable": True}}, {"caption_shuffle.seed": 0}),  # no seed anywhere: 0 (prompts.py:237)
        also="tests/test_caption_shuffle.py::test_the_copies_are_simpletuners",
    ),
    "repeats": _row(
        f"{CFG}:212 {H}metadata/backends/base.py:789",
        "each image is seen 1 + repeats times an epoch",
        ({"repeats": "2"}, {"repeats": 2}),
        also="tests/test_dialect_same_rows_datasets.py::test_repeats_count_each_image_one_plus_repeats_times",
    ),
    "is_regularisation_data": _row(
        f"{H}data_backend/factory.py:3509 {H}training/trainer.py:7069 {H}training/trainer.py:6155",
        "a LoRA trains these batches towards the base model's own prediction",
        ({"is_regularisation_data": True}, {"is_regularisation_data": True}),
    ),
    "is_regularization_data": _row(
        f"{H}data_backend/factory.py:3509",
        "SimpleTuner's other spelling of is_regularisation_data",
        ({"is_regularization_data": True}, {"is_regularisation_data": True}),
    ),
    "cache_dir_vae": _row(
        f"{H}data_backend/factory.py:4121 {H}data_backend/factory.py:1216",
        "the dataset's VAE cache folder, {model_family} filled in",
        ({"cache_dir_vae": "cache/vae/{model_family}/d"}, {"cache_dir_vae": "{cwd}/cache/vae/sd1x/d"}),
    ),
    "cache_dir": _row(
        f"{H}data_backend/factory.py:2457 {H}data_backend/factory.py:2487",
        "a text_embeds entry's cache folder",
        (
            {"__also__": [{"id": "text", "dataset_type": "text_embeds", "type": "local", "cache_dir": "cache/text"}]},
            {"@cache_config.text_cache_dir": "{cwd}/cache/text"},
        ),
    ),
    "conditioning_data": _row(
        f"{CFG}:223 {H}data_backend/factory.py:1587 {H}metadata/utils/duplicator.py:104 {H}training/collate.py:862",
        "the ids of the conditioning entries paired with this dataset: edit sources, and a mask for the loss",
        ({"conditioning_data": "sources", "__also__": [_SOURCES]}, {"conditioning_data_dir": "{cwd}/src"}),
        (
            {"conditioning_data": ["sources", "masks"], "__also__": [_SOURCES, _MASKS]},
            {"conditioning_data_dir": "{cwd}/src", "mask_data_dir": "{cwd}/masks", "mask_type": "mask"},
        ),
        family="qwen_image",
    ),
    "conditioning": _row(
        f"{H}metadata/utils/duplicator.py:217 {H}metadata/utils/duplicator.py:224 "
        f"{H}data_generation/sample_generator.py:498 {H}data_generation/sample_generator.py:499 "
        f"{H}data_generation/sample_generator.py:522 {H}data_generation/sample_generator.py:524 "
        f"{H}data_generation/sample_generator.py:526 {H}data_generation/conditioning.py:103 "
        f"{H}training/collate.py:1031",
        "a conditioning dataset generated from this one's images into <cache_dir>/conditioning_data/<id>_conditioning_"
        "<type>: canny = trainingsample's grey then canny_py(low 50, high 100), as RGB, saved in the image's format; "
        "one conditioning dataset trains on the images' captions",
        (
            {"conditioning": {"type": "canny", "conditioning_type": "controlnet", "captions": ["minecraft"]}},
            {"conditioning": {"type": "canny"}},
        ),
        (
            {"conditioning": [{"type": "canny", "low_threshold": 20, "high_threshold": 40}]},
            {"conditioning.low_threshold": 20, "conditioning.high_threshold": 40},
        ),
        also="tests/test_canny.py::test_edges_equal_simpletuners_generator "
        "tests/test_flux_kontext.py::test_the_published_kontext_example_trains_on_its_generated_canny_references",
    ),
    "conditioning_type": _row(
        f"{CFG}:224 {H}metadata/utils/duplicator.py:119 {H}training/collate.py:28 {H}models/common.py:6409 "
        f"{H}models/common.py:6417 {H}data_backend/factory.py:4529",
        "reference_strict: the source takes the edited image's size and crop keys; mask: the red channel weights "
        "each latent pixel's loss; segmentation: any non-black latent pixel counts, in masked_loss_probability of "
        "batches; an entry with a conditioning_type is a conditioning entry, `dataset_type` unset too",
        (
            {"conditioning_data": "sources", "__also__": [_SOURCES]},
            {"conditioning_data_dir": "{cwd}/src", "@datasets.1": UNSET},
        ),
        (  # as SimpleTuner's Kontext quickstart writes its reference entry: no `dataset_type`
            {"conditioning_data": "sources", "__also__": [{k: v for k, v in _SOURCES.items() if k != "dataset_type"}]},
            {"conditioning_data_dir": "{cwd}/src", "@datasets.1": UNSET},
        ),
        (
            {"conditioning_data": "masks", "__also__": [{**_MASKS, "conditioning_type": "segmentation"}]},
            {"mask_data_dir": "{cwd}/masks", "mask_type": "segmentation", "@datasets.1": UNSET},
        ),
        family="qwen_image",
        also="tests/test_masked_loss.py::test_the_cached_mask_is_the_region_the_image_shows_there "
        "tests/test_masked_loss.py::test_the_loss_is_the_loss_on_the_masked_region",
    ),
    "source_dataset_id": _row(
        f"{CFG}:219 {H}data_backend/factory.py:570 {H}metadata/utils/duplicator.py:162",
        "on a conditioning entry: the training dataset it follows",
        (
            {"conditioning_data": "sources", "__also__": [{**_SOURCES, "source_dataset_id": "d"}]},
            {"conditioning_data_dir": "{cwd}/src"},
        ),
        family="qwen_image",
    ),
    "aws_region_name": _row(
        f"{CFG}:157 {H}data_backend/aws.py:86 {H}data_backend/aws.py:89",
        "boto3's region_name, dropped when an endpoint is set",
        ({**_S3, "aws_region_name": "eu-west-1"}, {"storage_options.client_kwargs.region_name": "eu-west-1"}),
        (
            {**_S3, "aws_region_name": "eu-west-1", "aws_endpoint_url": "https://s3.example"},
            {"storage_options.client_kwargs": UNSET, "storage_options.endpoint_url": "https://s3.example"},
        ),
    ),
    "only_instance_prompt": _row(
        f"{H}data_backend/factory.py:3519",
        "captions are not read: every image gets the instance prompt, whatever caption_strategy says",
        (
            {"only_instance_prompt": True, "instance_prompt": "sks", "caption_strategy": "textfile"},
            {"caption_strategy": "instance_prompt"},
        ),
    ),
    "parquet": _row(
        f"{H}data_backend/factory.py:942 {H}data_backend/factory.py:944",
        "captions from a parquet / JSON table; filename_column `id` and caption_column `description` by default",
        (
            {"caption_strategy": "parquet", "parquet": {"path": "captions.jsonl"}},
            {"parquet.filename_column": "id", "parquet.caption_column": "description"},
        ),
    ),
    "video": _row(
        f"{H}models/wan/model.py:458 {H}data_backend/factory.py:872",
        "video.num_frames, rounded down to 8k+1 frames for Wan",
        ({"dataset_type": "video", "video": {"num_frames": 81}}, {"num_frames": 81}),
        ({"dataset_type": "video", "video": {"num_frames": 21}}, {"num_frames": 17}),
        family="wan",
    ),
}


def translated_dataset(tmp_path, fragment: dict, family: str = "sd1x") -> tuple[dict, dict]:
    """(the native dataset entry, the native config) for a SimpleTuner entry with ``fragment`` set (a None value
    removes the key); ``__also__`` lists more entries to write after it."""
    raw = write_project(tmp_path, {"model_family": family}, None, family)
    (tmp_path / "src").mkdir(exist_ok=True)
    base = json.loads((tmp_path / "multidatabackend.json").read_text())[0]
    entry = {k: v for k, v in {**base, **fragment}.items() if v is not None and k != "__also__"}
    (tmp_path / "multidatabackend.json").write_text(json.dumps([entry, *fragment.get("__also__", [])]))
    native, _ = dialect.translate(raw, None, tmp_path)
    validate_config(native, check_files=False)
    return native["datasets"][0], native


@pytest.mark.parametrize(
    "key,index", [(key, i) for key, row in DATASET_ROWS.items() for i in range(len(row.cases))], ids=lambda v: str(v)
)
def test_dataset_row_translates_to_simpletuners_meaning(tmp_path, key, index):
    row = DATASET_ROWS[key]
    given, expect = row.cases[index]
    dataset, native = translated_dataset(tmp_path, given, row.family)
    check_case(dataset, {k: v for k, v in expect.items() if not k.startswith("@")}, tmp_path)
    check_case(native, {k[1:]: v for k, v in expect.items() if k.startswith("@")}, tmp_path)


# --- behaviours checked against SimpleTuner's figures ------------------------------------------------------------

#: (entry keys, family, image size) -> the bucket SimpleTuner's TrainingSample.calculate_target_size
#: (image_manipulation/training_sample.py:587-650, its sizes from multiaspect/image.py:129-276, pixel_area converted
#: as data_backend/factory.py:2962-2983 does, alignment 64; 32 for Wan) gives; for `random` the set of buckets it
#: draws from.
BUCKETS = [
    (
        {"crop": True, "crop_aspect": "preserve", "resolution": 1024, "resolution_type": "pixel_area"},
        (1920, 1080),
        {(1344, 768)},
    ),
    ({"crop": False, "resolution": 1024, "resolution_type": "pixel"}, (1920, 1080), {(1792, 1024)}),
    ({"crop": False, "resolution": 1024, "resolution_type": "pixel"}, (1080, 1920), {(1024, 1856)}),
    ({"crop": True, "crop_aspect": "square", "resolution": 512, "resolution_type": "pixel"}, (800, 600), {(512, 512)}),
    ({"crop": True, "resolution": 1024, "resolution_type": "pixel_area"}, (1500, 1000), {(1024, 1024)}),
    ({"crop": False, "resolution": 1.0, "resolution_type": "area"}, (1500, 1000), {(1280, 832)}),
    ({"crop": False, "resolution": 0.5, "resolution_type": "area"}, (1500, 1000), {(832, 576)}),
    (
        {"crop": True, "crop_aspect": "closest", "crop_aspect_buckets": [0.75, 1.0, 1.5], "resolution": 512},
        (1400, 1000),
        {(640, 448)},
    ),
    (
        {"crop": True, "crop_aspect": "closest", "crop_aspect_buckets": [0.75, 1.0, 1.5], "resolution": 512},
        (600, 1000),
        {(448, 576)},
    ),
    ({"crop": True, "crop_aspect": "preserve", "resolution": 512, "__family__": "wan"}, (1920, 1080), {(672, 384)}),
    (
        {"crop": True, "crop_aspect": "random", "crop_aspect_buckets": [0.75, 1.5], "resolution": 512},
        (700, 700),
        {(448, 576), (640, 448)},
    ),
]


@pytest.mark.parametrize("entry,size,buckets", BUCKETS, ids=lambda v: str(v))
def test_buckets_are_simpletuners(tmp_path, entry, size, buckets):
    keys = {k: v for k, v in entry.items() if k != "__family__"}
    _, native = translated_dataset(tmp_path, keys, entry.get("__family__", "sd1x"))
    config = validate_config(native, check_files=False)
    geometry = geometry_for(config.datasets[0], config)
    drawn = {geometry.plan(*size, seed).bucket for seed in range(64)}
    assert drawn == buckets


#: meets_resolution_requirements (metadata/backends/base.py:1256-1276): pixel: both sides >= minimum; area: the
#: area >= minimum x 1e6 and, with a square crop, both sides >= floor(sqrt(that)); pixel_area R: R^2 / 1e6 MP
#: (factory.py:2982-2983). (entry keys, image size, kept?)
MINIMUM = [
    ({"resolution_type": "pixel", "minimum_image_size": 512}, (1000, 500), False),
    ({"resolution_type": "pixel", "minimum_image_size": 512}, (600, 512), True),
    ({"resolution_type": "area", "resolution": 0.25, "minimum_image_size": 0.25}, (600, 400), False),
    ({"resolution_type": "area", "resolution": 0.25, "minimum_image_size": 0.25}, (700, 400), True),
    ({"resolution_type": "area", "resolution": 0.25, "minimum_image_size": 0.25}, (1000, 300), True),
    ({"resolution_type": "area", "resolution": 0.25, "minimum_image_size": 0.25, "crop": True}, (1000, 300), False),
    ({"resolution_type": "pixel_area", "resolution": 512, "minimum_image_size": 512}, (600, 400), False),
    ({"resolution_type": "pixel_area", "resolution": 512, "minimum_image_size": 512}, (700, 400), True),
]


@pytest.mark.parametrize("entry,size,kept", MINIMUM, ids=lambda v: str(v))
def test_minimum_image_size_is_simpletuners(tmp_path, entry, size, kept):
    _, native = translated_dataset(tmp_path, entry)
    config = validate_config(native, check_files=False)
    assert geometry_for(config.datasets[0], config).is_below_minimum(*size) is not kept


def test_repeats_count_each_image_one_plus_repeats_times(tmp_path):
    # metadata/backends/base.py:789: len(images) * (repeats + 1): 3 images, repeats 2 -> 9 samples an epoch.
    _, native = translated_dataset(tmp_path, {"repeats": 2})
    for name in ("b", "c"):
        Image.new("RGB", (96, 64), "blue").save(tmp_path / "data" / f"{name}.png")
    config = validate_config(native, check_files=False)
    ds = config.datasets[0]
    meta = build_metadata(LocalDataBackend(tmp_path / "data", ds.id), ds, config, seed=0)
    assert len(meta.samples) == 9
