"""LocalDataBackend: listing, reading, identity, path safety, protocol conformance."""

from __future__ import annotations

import os

import pytest

from simpletuner.data_backend import IMAGE_EXTENSIONS, DataBackend, LocalDataBackend


@pytest.fixture
def tree(tmp_path):
    files = {
        "b.png": b"png-b",
        "a.JPG": b"jpg-a",
        "notes.txt": b"hello",
        "sub/deeper/c.webp": b"webp-c",
        "sub/d.jpeg": b"jpeg-d",
        "sub/e.gif": b"gif-e",
        "日本/猫.png": b"unicode",
        ".hidden.png": b"hidden",
        ".cache/f.png": b"in hidden dir",
        "sub/.g.png": b"hidden in sub",
    }
    for rel, data in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return tmp_path


def test_list_files_recursive_sorted_and_hidden_skipped(tree):
    backend = LocalDataBackend(tree, "ds")
    everything = backend.list_files()
    assert everything == sorted(everything)
    assert set(everything) == {
        "a.JPG",
        "b.png",
        "notes.txt",
        "sub/deeper/c.webp",
        "sub/d.jpeg",
        "sub/e.gif",
        "日本/猫.png",
    }


def test_list_files_filters_by_lowercase_extension(tree):
    backend = LocalDataBackend(tree, "ds")
    assert backend.list_files(IMAGE_EXTENSIONS) == ["a.JPG", "b.png", "sub/d.jpeg", "sub/deeper/c.webp", "日本/猫.png"]
    assert backend.list_files({".png"}) == ["b.png", "日本/猫.png"]
    assert backend.list_files({".txt"}) == ["notes.txt"]
    assert backend.list_files(set()) == []


def test_read_exists_size(tree):
    backend = LocalDataBackend(tree, "ds")
    assert backend.read("sub/deeper/c.webp") == b"webp-c"
    assert backend.read("日本/猫.png") == b"unicode"
    assert backend.exists("b.png") and not backend.exists("nope.png")
    assert not backend.exists("sub")  # a folder is not a file
    assert backend.size("notes.txt") == 5


def test_missing_file_error_names_the_path(tree):
    backend = LocalDataBackend(tree, "ds")
    with pytest.raises(FileNotFoundError, match="missing/x.png"):
        backend.read("missing/x.png")
    with pytest.raises(FileNotFoundError, match="gone.png"):
        backend.identity("gone.png")


def test_identity_changes_when_file_is_rewritten(tree):
    backend = LocalDataBackend(tree, "ds")
    first = backend.identity("b.png")
    assert first == backend.identity("b.png")
    path = tree / "b.png"
    path.write_bytes(b"png-b")  # same bytes, new mtime
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    second = backend.identity("b.png")
    assert second != first
    path.write_bytes(b"longer content")
    assert backend.identity("b.png") not in (first, second)
    assert backend.identity("b.png").startswith("14:")


@pytest.mark.parametrize("bad", ["../outside.png", "sub/../../outside.png", "/etc/passwd", ""])
def test_paths_escaping_the_root_are_refused(tree, bad):
    backend = LocalDataBackend(tree / "sub", "ds")
    (tree / "outside.png").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a relative path inside"):
        backend.read(bad)
    with pytest.raises(ValueError):
        backend.exists(bad)


def test_root_must_be_a_folder(tmp_path):
    with pytest.raises(ValueError, match="instance_data_dir"):
        LocalDataBackend(tmp_path / "absent", "ds")


def test_conforms_to_protocol(tree):
    backend = LocalDataBackend(tree, "ds")
    assert isinstance(backend, DataBackend)
    assert backend.id == "ds"
