"""IncrementalDetokenizer over the real SmolLM2 tokenizer: streamed deltas concatenate to the full decode, never
show half a character, and keep leading spaces."""

from __future__ import annotations

import random
from typing import Any

import pytest

from dspark.engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    " Héllo wörld, naïve café, Ærøskøbing, Ångström",
    "日本語のテキストと中文字符测试",
    "Rockets 🚀🎉 and a family 👨\u200d👩\u200d👧 with flags 🇫🇷🇯🇵 and a thumbs 👍🏽",
    "  two leading spaces, then\n\nnew lines\tand a tab",
    " — “quotes” ¿qué? ½ ∑ ∞ ≠ Ωmega façade",
    "mixed: abc日本🚀é def 😀😃😄 end",
    "a . b , c ! d ?",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    from dspark.models.registry import resolve_model
    from dspark.models.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def chat_prompt(tok: Any) -> list[int]:
    return tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def stream(tok: Any, prompt: list[int], ids: list[int], chunk: int = 1, skip: bool = True) -> list[str]:
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    return [d.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


def test_texts_really_split_characters_across_tokens(tok: Any) -> None:
    # Otherwise the streaming tests below would prove nothing about multi-byte characters.
    split = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        split += sum("\ufffd" in tok.decode([i]) for i in ids)
    assert split > 20


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt_kind", ["chat", "empty", "cjk"])
def test_stream_token_by_token_equals_full_decode(
    tok: Any, chat_prompt: list[int], text: str, prompt_kind: str
) -> None:
    prompt = {"chat": chat_prompt, "empty": [], "cjk": tok.encode("前の文脈🚀", add_special_tokens=False)}[prompt_kind]
    ids = tok.encode(text, add_special_tokens=False)
    expected = tok.decode(ids)
    assert expected == text
    deltas = stream(tok, prompt, ids)
    assert "".join(deltas) == expected
    assert not any("\ufffd" in d for d in deltas), deltas
    assert sum(1 for d in deltas if d) > 1  # it really streams


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_stream_in_chunks_equals_full_decode(tok: Any, chat_prompt: list[int], chunk: int) -> None:
    ids = tok.encode("".join(TEXTS), add_special_tokens=False)
    deltas = stream(tok, chat_prompt, ids, chunk=chunk)
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_emoji_is_held_back_until_complete(tok: Any, chat_prompt: list[int]) -> None:
    ids = tok.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1
    deltas = stream(tok, chat_prompt, ids)
    assert deltas == [""] * (len(ids) - 1) + ["🚀"]


def test_leading_spaces_are_preserved(tok: Any, chat_prompt: list[int]) -> None:
    for text in (" Hello", "  Hello", " 日本", "\n Hi"):
        ids = tok.encode(text, add_special_tokens=False)
        deltas = stream(tok, chat_prompt, ids)
        assert "".join(deltas) == text
        first = next(d for d in deltas if d)
        assert first[0] == text[0]
    # A space-led token right after a word in the prompt keeps its space.
    prompt = tok.encode("The answer is", add_special_tokens=False)
    ids = tok.encode(" forty two", add_special_tokens=False)
    assert stream(tok, prompt, ids)[0] == " forty"


def test_prompt_context_starting_mid_character(tok: Any) -> None:
    # The last CONTEXT_TOKENS prompt tokens start inside an emoji: that garbage must never reach the output.
    prompt = tok.encode("🎉🎉🎉 ok", add_special_tokens=False)
    window = prompt[-CONTEXT_TOKENS:]
    assert tok.decode(window).startswith("\ufffd")
    ids = tok.encode(" ok 🎉 done", add_special_tokens=False)
    deltas = stream(tok, prompt, ids)
    assert "".join(deltas) == " ok 🎉 done"
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(tok: Any, chat_prompt: list[int]) -> None:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*tok.encode(" Hi there", add_special_tokens=False), eos]
    assert "".join(stream(tok, chat_prompt, ids, skip=True)) == " Hi there"
    assert "".join(stream(tok, chat_prompt, ids, skip=False)) == " Hi there<|im_end|>"
    # Text after a skipped special token still streams.
    more = [*ids, *tok.encode(" again", add_special_tokens=False)]
    deltas = stream(tok, chat_prompt, more, skip=True)
    assert "".join(deltas) == tok.decode(more, skip_special_tokens=True) == " Hi there again"


@pytest.mark.parametrize("text", TEXTS)
def test_adding_all_at_once_gives_the_streamed_text(tok: Any, chat_prompt: list[int], text: str) -> None:
    """add_all (a final_only request, decoded when it ends) equals the streamed deltas, also when the tokens end in
    the middle of a character (which both leave out)."""
    ids = tok.encode(text, add_special_tokens=False)
    for end in range(1, len(ids) + 1):
        once = IncrementalDetokenizer(tok, chat_prompt).add_all(ids[:end])
        assert once == "".join(stream(tok, chat_prompt, ids[:end])), (text, end)


def _offsets_only(tok: Any, prompt: list[int], skip: bool) -> IncrementalDetokenizer:
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    d._use_offsets = True
    return d


def test_the_decode_stream_gives_the_offsets_text_on_random_tokens(tok: Any) -> None:
    """add() runs on the tokenizer's DecodeStream; on random token ids (byte tokens and special tokens among them) and
    random prompts its deltas are those of the offsets it replaced, one by one. A prompt context that ends inside a
    character (half an emoji) keeps the offsets, which give the right text there."""
    rng = random.Random(0)
    vocab = len(tok)
    half_emoji = tok.encode("🚀", add_special_tokens=False)[:1]
    num_streamed = num_fallback = 0
    for trial in range(300):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 9))] + (half_emoji if trial % 5 == 0 else [])
        kinds = 3 if trial % 2 else 1  # odd trials: byte tokens and special ones too
        ids = [
            (rng.randrange(vocab), rng.randrange(300), rng.choice([0, 1, 2]))[rng.randrange(kinds)]
            for _ in range(rng.randint(1, 30))
        ]
        for skip in (True, False):
            d, ref = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip), _offsets_only(tok, prompt, skip)
            assert [d.add([t]) for t in ids] == [ref.add([t]) for t in ids], (prompt, ids, skip)
            num_streamed += d._stream is not None
            num_fallback += d._stream is None
    assert num_streamed > 400 and num_fallback >= 120  # both ran; every prompt ending in half an emoji fell back


def _byte_fallback_tokenizer() -> tuple[Any, dict[str, int]]:
    """A SentencePiece-style (Llama 2) tokenizer: BPE with byte fallback, a Replace / ByteFallback / Fuse / Strip
    decoder, no merges."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "▁Hello", "▁world", "a", "▁a", "日"]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **special)
    return tok, vocab


def test_a_byte_fallback_decoder_keeps_the_offsets_and_a_raising_stream_falls_back() -> None:
    """Under a ByteFallback decoder a byte run that is not UTF-8 turns bytes already shown ("\\n" here) into U+FFFD, and
    DecodeStream raises "Invalid prefix" where the offsets go on: such a tokenizer never gets the stream. Forced onto
    one, the raise hands over to the offsets, which give the offsets' text from there (not a failed request)."""
    tok, vocab = _byte_fallback_tokenizer()
    prompt = [vocab["<s>"], vocab["▁Hello"]]
    ids = [vocab["<0x0A>"], vocab["<0xE6>"], vocab["<0x97>"], vocab["▁world"]]
    ref = _offsets_only(tok, prompt, True)
    want = [ref.add([t]) for t in ids]
    assert want[-1].endswith(" world")
    d = IncrementalDetokenizer(tok, prompt)
    got = [d.add([ids[0]])]
    assert d._stream is None  # never made for this decoder
    assert got + [d.add([t]) for t in ids[1:]] == want
    forced = IncrementalDetokenizer(tok, prompt)
    forced._use_offsets = False
    got = [forced.add([ids[0]])]
    assert forced._stream is not None  # the stream ran the first token
    got += [forced.add([t]) for t in ids[1:]]
    assert got == want and forced._stream is None  # it raised, and the offsets took over
    rng = random.Random(1)
    for _ in range(300):  # random ids, a stream forced on: always the offsets' text, raising or not
        prompt = [rng.randrange(len(vocab)) for _ in range(rng.randint(0, 6))]
        ids = [rng.randrange(len(vocab)) for _ in range(rng.randint(1, 20))]
        forced = IncrementalDetokenizer(tok, prompt)
        forced._use_offsets = False
        ref = _offsets_only(tok, prompt, True)
        assert [forced.add([t]) for t in ids] == [ref.add([t]) for t in ids], (prompt, ids)
