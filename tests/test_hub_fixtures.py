"""The Hub stand-ins in hub_fixtures.py, proved with the real huggingface_hub client."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from hub_fixtures import copy_folder_to_hub_cache, lay_out_hub_cache, repo_folder, use_hub_cache
from huggingface_hub import hf_hub_download, snapshot_download, try_to_load_from_cache
from huggingface_hub.errors import LocalEntryNotFoundError

MODEL_FILES: dict[str, bytes] = {
    "model_index.json": b'{"_class_name": "StableDiffusionPipeline"}',
    "unet/config.json": b'{"sample_size": 8}',
    "unet/diffusion_pytorch_model.safetensors": b"unet weights",
    "vae/diffusion_pytorch_model.safetensors": b"vae weights",
    "vae/diffusion_pytorch_model.bin": b"old vae weights",
}


def test_layout_matches_huggingface_hub(tmp_path):
    commit = lay_out_hub_cache(tmp_path, "org/model", MODEL_FILES)
    storage = tmp_path / "models--org--model"
    assert len(commit) == 40 and int(commit, 16) >= 0
    assert (storage / "refs" / "main").read_text() == commit
    pointer = storage / "snapshots" / commit / "unet" / "config.json"
    assert pointer.is_symlink() and not os.path.isabs(os.readlink(pointer))
    assert pointer.resolve().parent == (storage / "blobs").resolve()
    assert pointer.read_bytes() == MODEL_FILES["unet/config.json"]
    # a git file is named by its git blob id, an LFS file by its sha256
    data = MODEL_FILES["unet/config.json"]
    assert pointer.resolve().name == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    weights = storage / "snapshots" / commit / "unet" / "diffusion_pytorch_model.safetensors"
    assert weights.resolve().name == hashlib.sha256(b"unet weights").hexdigest()
    assert (tmp_path / "CACHEDIR.TAG").exists()
    assert set(json.loads((storage / "trees" / f"{commit}.json").read_text())["files"]) == set(MODEL_FILES)
    # deterministic from the content, or as given
    assert lay_out_hub_cache(tmp_path / "b", "org/model", MODEL_FILES) == commit
    assert lay_out_hub_cache(tmp_path / "c", "org/model", {"a.txt": b"other"}) != commit
    assert lay_out_hub_cache(tmp_path / "d", "org/model", MODEL_FILES, commit="ab" * 20) == "ab" * 20
    assert repo_folder(tmp_path, "org/data", "dataset").name == "datasets--org--data"


def test_snapshot_download_finds_the_cache(tmp_path):
    commit = lay_out_hub_cache(tmp_path, "org/model", MODEL_FILES)
    folder = snapshot_download("org/model", cache_dir=tmp_path, local_files_only=True)
    assert folder == str(tmp_path.resolve() / "models--org--model" / "snapshots" / commit)
    assert (tmp_path / "models--org--model" / "snapshots" / commit / "model_index.json").read_bytes() == (
        MODEL_FILES["model_index.json"]
    )
    allowed = snapshot_download(
        "org/model", cache_dir=tmp_path, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]
    )
    assert allowed == folder
    # by the commit hash, and offline (the suite's HF_HUB_OFFLINE=1) without local_files_only
    assert snapshot_download("org/model", cache_dir=tmp_path, revision=commit, local_files_only=True) == folder
    assert snapshot_download("org/model", cache_dir=tmp_path) == folder


def test_revisions_and_missing_repos(tmp_path):
    main = lay_out_hub_cache(tmp_path, "org/model", MODEL_FILES)
    v1 = lay_out_hub_cache(tmp_path, "org/model", {"model_index.json": b"{}"}, revision="v1")
    assert v1 != main
    v1_folder = snapshot_download("org/model", cache_dir=tmp_path, revision="v1", local_files_only=True)
    assert os.listdir(v1_folder) == ["model_index.json"]
    assert snapshot_download("org/model", cache_dir=tmp_path, local_files_only=True).endswith(main)
    with pytest.raises(LocalEntryNotFoundError):
        snapshot_download("org/model", cache_dir=tmp_path, revision="v2", local_files_only=True)
    with pytest.raises(LocalEntryNotFoundError):
        snapshot_download("org/other", cache_dir=tmp_path, local_files_only=True)


def test_hf_hub_download_finds_a_file(tmp_path):
    commit = lay_out_hub_cache(tmp_path, "org/model", MODEL_FILES)
    path = hf_hub_download("org/model", "unet/config.json", cache_dir=tmp_path, local_files_only=True)
    assert path == str(tmp_path.resolve() / "models--org--model" / "snapshots" / commit / "unet" / "config.json")
    assert try_to_load_from_cache("org/model", "unet/config.json", cache_dir=tmp_path) == path
    with pytest.raises(LocalEntryNotFoundError):
        hf_hub_download("org/model", "text_encoder/config.json", cache_dir=tmp_path, local_files_only=True)


def test_dataset_repo(tmp_path):
    files = {"data/train-00000-of-00001.parquet": b"PAR1 rows PAR1", "README.md": b"# data"}
    commit = lay_out_hub_cache(tmp_path, "org/data", files, repo_type="dataset")
    folder = snapshot_download(
        "org/data", repo_type="dataset", cache_dir=tmp_path, local_files_only=True, allow_patterns="*.parquet"
    )
    assert folder.endswith(f"datasets--org--data/snapshots/{commit}")
    path = hf_hub_download(
        "org/data", "data/train-00000-of-00001.parquet", repo_type="dataset", cache_dir=tmp_path, local_files_only=True
    )
    assert open(path, "rb").read() == files["data/train-00000-of-00001.parquet"]
    with pytest.raises(LocalEntryNotFoundError):  # a model repo of that name is not there
        snapshot_download("org/data", cache_dir=tmp_path, local_files_only=True)


def test_copied_folder_and_default_cache(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "unet").mkdir(parents=True)
    (src / "model_index.json").write_text("{}")
    (src / "unet" / "config.json").write_text('{"a": 1}')
    cache = use_hub_cache(monkeypatch, tmp_path / "hub")
    commit = copy_folder_to_hub_cache(cache, "org/copied", src)
    folder = snapshot_download("org/copied", local_files_only=True)  # no cache_dir: the default cache
    assert folder.endswith(commit)
    assert sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*")) == [
        "model_index.json",
        "unet",
        "unet/config.json",
    ]


def test_tiny_zoo_model_loads_from_the_cache(tmp_path, tiny_sd):
    """A tiny diffusers pipeline copied into the cache loads through diffusers by its hub id, offline."""
    from diffusers import UNet2DConditionModel

    copy_folder_to_hub_cache(tmp_path, "org/tiny-sd", tiny_sd)
    folder = snapshot_download("org/tiny-sd", cache_dir=tmp_path, local_files_only=True)
    assert os.path.exists(os.path.join(folder, "unet", "config.json"))
    unet = UNet2DConditionModel.from_pretrained("org/tiny-sd", subfolder="unet", cache_dir=tmp_path)
    assert unet.config.cross_attention_dim == 32


# -- the local Hub server, with the real client online ----------------------------------------------------------------


def test_server_snapshot_download_then_offline(hub_server, tmp_path, monkeypatch):
    main = hub_server.add_repo("org/model", MODEL_FILES)
    v1 = hub_server.add_repo("org/model", {**MODEL_FILES, "unet/config.json": b'{"sample_size": 16}'}, revision="v1")
    folder = snapshot_download(
        "org/model", cache_dir=tmp_path, revision="v1", allow_patterns=["*.json", "*.safetensors"]
    )
    assert folder == str(tmp_path.resolve() / "models--org--model" / "snapshots" / v1)
    got = sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file())
    assert got == sorted(p for p in MODEL_FILES if not p.endswith(".bin"))
    assert (Path(folder) / "unet" / "config.json").read_bytes() == b'{"sample_size": 16}'
    # the server's layout is the one lay_out_hub_cache writes: same commit, same blob names, same refs
    assert lay_out_hub_cache(tmp_path / "laid", "org/model", MODEL_FILES) == main
    blobs = {p.name for p in (tmp_path / "models--org--model" / "blobs").iterdir()}
    assert Path(folder, "vae", "diffusion_pytorch_model.safetensors").resolve().name in blobs
    assert (tmp_path / "models--org--model" / "refs" / "v1").read_text() == v1
    assert ("HEAD", "/org/model/resolve/" + v1 + "/unet/config.json") in hub_server.requests
    assert not hub_server.unhandled
    # then offline, the same call finds it in the cache without the server
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    count = len(hub_server.requests)
    again = snapshot_download(
        "org/model", cache_dir=tmp_path, revision="v1", allow_patterns=["*.json", "*.safetensors"]
    )
    assert again == folder and len(hub_server.requests) == count


def test_server_hf_hub_download_and_file_errors(hub_server, tmp_path):
    from huggingface_hub.errors import EntryNotFoundError

    commit = hub_server.add_repo("org/model", MODEL_FILES)
    path = hf_hub_download("org/model", "unet/diffusion_pytorch_model.safetensors", cache_dir=tmp_path)
    assert path.endswith(f"snapshots/{commit}/unet/diffusion_pytorch_model.safetensors")
    assert Path(path).read_bytes() == b"unet weights"
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("org/model", "nope.json", cache_dir=tmp_path)
    # without cache_dir: the test's own default cache, never the user's
    assert snapshot_download("org/model") == str(hub_server.cache_dir / "models--org--model" / "snapshots" / commit)


def test_server_errors_map_to_the_clients_exceptions(hub_server, tmp_path):
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    hub_server.add_repo("org/gated", MODEL_FILES, gated=True)
    hub_server.add_repo("org/private", MODEL_FILES, private=True)
    hub_server.add_repo("org/model", MODEL_FILES)
    with pytest.raises(GatedRepoError):
        snapshot_download("org/gated", cache_dir=tmp_path)
    with pytest.raises(GatedRepoError):
        hf_hub_download("org/gated", "model_index.json", cache_dir=tmp_path)
    assert snapshot_download("org/gated", cache_dir=tmp_path, token=hub_server.token)  # a token opens it
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/missing", cache_dir=tmp_path)
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/private", cache_dir=tmp_path)
    assert snapshot_download("org/private", cache_dir=tmp_path, token=hub_server.token)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download("org/model", cache_dir=tmp_path, revision="v9")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("org/model", "model_index.json", cache_dir=tmp_path, revision="v9")
    assert not hub_server.unhandled


def test_server_dataset_parquet_files(hub_server, tmp_path):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    files = {
        "data/train-00000-of-00002.parquet": b"PAR1 part one PAR1",
        "data/train-00001-of-00002.parquet": b"PAR1 part two PAR1",
        "README.md": b"---\nlicense: mit\n---\n# data",
    }
    commit = hub_server.add_repo("org/data", files, repo_type="dataset")
    folder = snapshot_download("org/data", repo_type="dataset", cache_dir=tmp_path, allow_patterns="*.parquet")
    assert folder.endswith(f"datasets--org--data/snapshots/{commit}")
    assert sorted(os.listdir(Path(folder) / "data")) == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    assert not (Path(folder) / "README.md").exists()
    api = HfApi()
    assert sorted(api.list_repo_files("org/data", repo_type="dataset")) == sorted(files)
    info = api.dataset_info("org/data", files_metadata=True)
    assert info.sha == commit and {s.rfilename for s in info.siblings or []} == set(files)
    with pytest.raises(RepositoryNotFoundError):  # a model of that name does not exist
        snapshot_download("org/data", cache_dir=tmp_path / "other")
    assert not hub_server.unhandled


def test_server_upload_folder_records_the_commit(hub_server, tmp_path):
    from huggingface_hub import HfApi, create_repo, upload_file, upload_folder

    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "pytorch_lora_weights.safetensors").write_bytes(b"lora weights")
    (out / "README.md").write_text("---\nbase_model: org/model\n---\n# LoRA\n")
    (out / "checkpoint-2" / "state.json").write_text('{"step": 2}')
    url = create_repo("me/lora", private=True, token=hub_server.token)
    assert url.repo_id == "me/lora" and hub_server.repo("me/lora").private
    info = upload_folder(repo_id="me/lora", folder_path=out, commit_message="Final adapter", token=hub_server.token)
    commit = hub_server.commits[-1]
    assert commit.message == "Final adapter" and commit.oid == info.oid
    assert commit.files == {
        "pytorch_lora_weights.safetensors": b"lora weights",
        "README.md": b"---\nbase_model: org/model\n---\n# LoRA\n",
        "checkpoint-2/state.json": b'{"step": 2}',
    }
    kinds = {op["value"]["path"]: op["key"] for op in commit.operations if op["key"] != "header"}
    assert kinds["pytorch_lora_weights.safetensors"] == "lfsFile" and kinds["README.md"] == "file"
    upload_file(path_or_fileobj=b"more", path_in_repo="notes.txt", repo_id="me/lora", token=hub_server.token)
    assert set(hub_server.repo_files("me/lora")) == {".gitattributes", "notes.txt", *commit.files}
    # the private repo reads back with the token (and is not found without it)
    assert HfApi(token=hub_server.token).model_info("me/lora").private is True
    assert not hub_server.unhandled


def test_server_upload_with_xet_on_goes_regular(tmp_path, monkeypatch):
    """With Xet left on (as on a user's machine), upload_folder takes the pipelined path; the server answers every
    file "regular" so nothing goes to Xet storage."""
    from hub_server import HubServer
    from huggingface_hub import create_repo, upload_folder

    with HubServer() as server:
        server.use(monkeypatch, xet=True)
        (tmp_path / "w.safetensors").write_bytes(b"weights")
        create_repo("me/xet", token=server.token)
        upload_folder(repo_id="me/xet", folder_path=tmp_path, token=server.token)
        assert server.commits[-1].files == {"w.safetensors": b"weights"}
        assert not server.unhandled


def test_server_writes_need_a_token(hub_server, tmp_path, monkeypatch):
    from huggingface_hub import create_repo, upload_folder
    from huggingface_hub.errors import HfHubHTTPError

    (tmp_path / "a.txt").write_text("a")
    with pytest.raises(HfHubHTTPError) as raised:
        create_repo("me/lora", private=True)
    assert raised.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as raised:
        create_repo("me/lora", token="hf_wrong")
    assert raised.value.response.status_code == 401
    create_repo("me/lora", token=hub_server.token)
    with pytest.raises(HfHubHTTPError) as raised:
        upload_folder(repo_id="me/lora", folder_path=tmp_path)
    assert raised.value.response.status_code == 401
    assert [c.repo_id for c in hub_server.commits] == []
    # HF_TOKEN in the environment is the client's implicit token
    monkeypatch.setenv("HF_TOKEN", hub_server.token)
    upload_folder(repo_id="me/lora", folder_path=tmp_path)
    assert hub_server.commits[-1].files == {"a.txt": b"a"}


def test_server_serves_a_tiny_zoo_model_to_diffusers(hub_server, tmp_path, tiny_sd):
    """diffusers' own hub paths (hf_hub_download of one component, DiffusionPipeline.download) work against it."""
    from diffusers import DiffusionPipeline, UNet2DConditionModel
    from hub_fixtures import folder_files

    commit = hub_server.add_repo("org/tiny-sd", folder_files(tiny_sd))
    unet = UNet2DConditionModel.from_pretrained("org/tiny-sd", subfolder="unet", cache_dir=tmp_path)
    assert unet.config.cross_attention_dim == 32
    folder = DiffusionPipeline.download("org/tiny-sd", cache_dir=tmp_path)
    assert folder.endswith(commit) and os.path.exists(os.path.join(folder, "model_index.json"))
    assert not hub_server.unhandled


def test_server_file_system_ranges(hub_server):
    """HfFileSystem (fsspec, what pyarrow and `datasets` read hub files through): listing, globbing, ranged reads."""
    from huggingface_hub import HfFileSystem

    data = bytes(range(256)) * 4
    hub_server.add_repo("org/data", {"data/train.parquet": data, "README.md": b"# d"}, repo_type="dataset")
    fs = HfFileSystem()
    assert fs.glob("datasets/org/data/**/*.parquet") == ["datasets/org/data/data/train.parquet"]
    assert fs.info("datasets/org/data/data/train.parquet")["size"] == len(data)
    with fs.open("datasets/org/data/data/train.parquet", "rb", block_size=100) as f:
        f.seek(300)
        assert f.read(50) == data[300:350]
    assert fs.cat_file("datasets/org/data/data/train.parquet", start=-10) == data[-10:]
    assert not hub_server.unhandled


def test_server_injected_failures(hub_server, tmp_path):
    from huggingface_hub import create_repo, upload_file
    from huggingface_hub.errors import HfHubHTTPError

    create_repo("me/lora", token=hub_server.token)
    hub_server.fail("POST", r"/commit/", status=503)
    with pytest.raises(HfHubHTTPError) as raised:
        upload_file(path_or_fileobj=b"a", path_in_repo="a.txt", repo_id="me/lora", token=hub_server.token)
    assert raised.value.response.status_code == 503 and not hub_server.commits
    upload_file(path_or_fileobj=b"a", path_in_repo="a.txt", repo_id="me/lora", token=hub_server.token)  # next one
    assert hub_server.commits[-1].files == {"a.txt": b"a"}
