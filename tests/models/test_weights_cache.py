"""The GGUF weights cache (models/weights_cache.py): a second load reads the cached safetensors instead of parsing the
GGUF, with the same config and the same bits; a changed file, a broken entry or DSPARK_WEIGHTS_CACHE=0 parse again."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest
import torch
from test_gguf_loading import tiny_hf_model, write_gguf

from dspark.models import loader, weights_cache


@pytest.fixture
def gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(weights_cache.ENV, raising=False)
    monkeypatch.setattr(weights_cache, "MIN_BYTES", 0)  # the tiny file counts as big
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_hf_model("llama", tied=False), "llama", path, gguf.GGMLQuantizationType.Q8_0)
    return path


def _load(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loader.load_model(path, torch.float32, torch.device("cpu")).state_dict().items()}


def _parses(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record every GGUF parse from here on."""
    calls: list[Path] = []
    real = loader.open_gguf

    def counted(path: Path) -> object:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(loader, "open_gguf", counted)
    return calls


def test_the_second_load_reads_the_cache_and_gives_the_same_bits(
    gguf_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parses = _parses(monkeypatch)
    first = _load(gguf_file)
    assert len(parses) == 1 and (weights_cache.entry(gguf_file) / "model.safetensors").is_file()
    second = _load(gguf_file)
    assert len(parses) == 1  # no parse: config and tensors came from the entry
    assert loader.load_config(gguf_file) == loader.gguf_config(loader.open_gguf(gguf_file), gguf_file)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_a_changed_file_or_a_broken_entry_is_parsed_again(gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = _load(gguf_file)
    parses = _parses(monkeypatch)
    old = weights_cache.entry(gguf_file)
    st = gguf_file.stat()
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: another key
    assert weights_cache.entry(gguf_file) != old
    assert _load(gguf_file).keys() == want.keys() and len(parses) == 1
    tensors = weights_cache.entry(gguf_file) / "model.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:1000])  # truncated: unreadable, so absent
    got = _load(gguf_file)
    assert len(parses) == 2 and all(torch.equal(got[k], want[k]) for k in want)
    assert tensors.stat().st_size > 1000  # written again
    _load(gguf_file)
    assert len(parses) == 2


def test_the_cache_can_be_turned_off(gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(weights_cache.ENV, "0")
    parses = _parses(monkeypatch)
    _load(gguf_file)
    _load(gguf_file)
    assert len(parses) == 2 and not weights_cache.entry(gguf_file).exists()
