"""The GGUF tokenizer is converted once and then loaded from $DSPARK_CACHE, identical in every respect we use."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark.models.tokenizer import load_tokenizer


@pytest.mark.slow
def test_gguf_tokenizer_is_cached_and_identical(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    first = load_tokenizer(smollm2_path)
    cached = list((tmp_path / "tokenizers").iterdir())
    assert len(cached) == 1 and (cached[0] / "tokenizer_config.json").is_file()
    second = load_tokenizer(smollm2_path)
    text = "Héllo wörld 你好 🎉\ndef f(x):\n    return x  # done"
    messages = [{"role": "user", "content": text}]
    assert second.encode(text) == first.encode(text)
    assert second.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        first.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert (second.eos_token_id, second.bos_token_id, len(second)) == (
        first.eos_token_id,
        first.bos_token_id,
        len(first),
    )


@pytest.mark.slow
def test_unwritable_cache_still_loads(smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DSPARK_CACHE", str(blocker))
    assert load_tokenizer(smollm2_path).eos_token_id == 2
