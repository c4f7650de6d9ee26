"""Prompts the target writes itself (Magpie, Xu et al. 2024): its chat template rendered up to where a user's text
would start, sampled until the end of the turn. The target's own questions widen the prompt pool without an external
corpus, in the style of what it was tuned on. Filters drop the junk (too short or too long, mostly non-letters,
repetitive, holding template tokens) and near-duplicates. A finished exchange gets a follow-up user turn the same way,
which makes two-turn prompts.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from dspark.config import SamplingParams
from dspark.errors import ConfigError
from dspark.llm import LLM, Message
from dspark.outputs import CompletionOutput
from dspark.train.data import Prompt, Sequence, run_requests

# Plain letters and digits: a template that trims, escapes or title-cases nothing else still renders it whole.
PLACEHOLDER = "MagpieUserText7c1f42"
MIN_WORDS = 4
MAX_WORDS = 256
MAX_CHARS = 2000
MIN_LETTER_SHARE = 0.4  # of the visible characters: "What is 12 + 35 * 4?" has 43%
MAX_TOP_WORD_SHARE = 0.4  # of the words, once a word comes 3 times or more ("how how how how")
MIN_DISTINCT_TRIGRAMS = 0.6  # of the word trigrams, from 10 trigrams on
MAX_LINE_REPEATS = 2  # times the same line of 10 characters or more may come
NEAR_DUP_WORDS = 8
ROLE_LINE = re.compile(r"^\s*(system|user|assistant)\s*:?\s*$", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class OpenTurn:
    prefix: str  # the rendered template up to where the user's text starts
    stop_token_id: int  # the token that closes the user's turn


def open_user_turn(tokenizer: Any, history: Seq[Message] = ()) -> OpenTurn:
    """The chat template with a user turn open after history, found by rendering a placeholder user text and cutting
    there (no template's tokens are written here); the first token after the text is what ends the turn."""
    rendered = tokenizer.apply_chat_template(
        [*history, {"role": "user", "content": PLACEHOLDER}], tokenize=False, add_generation_prompt=False
    )
    if not isinstance(rendered, str) or rendered.count(PLACEHOLDER) != 1:
        raise ConfigError("chat_template", PLACEHOLDER, "a template that renders a user's text verbatim, once")
    prefix, rest = rendered.split(PLACEHOLDER)
    rest_ids = tokenizer.encode(rest, add_special_tokens=False)
    if not rest_ids or rest_ids[0] not in tokenizer.all_special_ids:
        raise ConfigError("chat_template", rest, "a template whose user turn ends with a special token")
    return OpenTurn(prefix, rest_ids[0])


def rejection(text: str, markers: Seq[str] = ()) -> str | None:
    """Why a written user turn is dropped ("template", "short", "long", "non-letters" or "repetitive"), or None to
    keep it. text is taken stripped; markers are the strings of the template's special tokens."""
    text = text.strip()
    if any(m in text for m in markers) or ROLE_LINE.search(text):
        return "template"  # the target wrote a whole exchange, or a header, not a question
    words = text.split()
    if len(words) < MIN_WORDS:
        return "short"
    if len(words) > MAX_WORDS or len(text) > MAX_CHARS:
        return "long"
    visible = [c for c in text if not c.isspace()]
    if sum(c.isalpha() for c in visible) < MIN_LETTER_SHARE * len(visible):
        return "non-letters"
    lower = [w.lower() for w in words]
    top_count = Counter(lower).most_common(1)[0][1]
    trigrams = list(zip(lower, lower[1:], lower[2:], strict=False))
    long_lines = Counter(line.strip() for line in text.splitlines() if len(line.strip()) >= 10)
    if (
        (top_count >= 3 and top_count > MAX_TOP_WORD_SHARE * len(words))
        or (len(trigrams) >= 10 and len(set(trigrams)) < MIN_DISTINCT_TRIGRAMS * len(trigrams))
        or (long_lines and max(long_lines.values()) > MAX_LINE_REPEATS)
    ):
        return "repetitive"
    return None


class Deduplicator:
    """Remembers prompts by their first near_dup_words words, lower-cased, punctuation dropped: add() is False for a
    prompt seen before that way. Prompts equal up to case, spacing and punctuation share those words, so exact
    duplicates are caught too, and so are the many variants of one opening a sampled target writes."""

    def __init__(self, near_dup_words: int = NEAR_DUP_WORDS) -> None:
        self.near_dup_words = near_dup_words
        self.keys: set[str] = set()

    def add(self, text: str) -> bool:
        key = " ".join(re.findall(r"\w+", text.lower())[: self.near_dup_words])
        if key in self.keys:
            return False
        self.keys.add(key)
        return True


def template_markers(tokenizer: Any) -> list[str]:
    return [t for t in tokenizer.all_special_tokens if t]


def magpie_prompts(
    llm: LLM,
    n: int,
    seed: int = 0,
    temperature: float = 1.0,
    max_tokens: int = 128,
    max_rounds: int = 4,
    deadline: float | None = None,
    progress: bool = False,
) -> list[Prompt]:
    """Up to n distinct user turns written by the target, each from its own seed (seed, seed + 1, ...), that pass
    rejection(). Each round asks for twice the number still missing; fewer than n come back when max_rounds or the
    deadline (time.monotonic()) run out first. A turn cut at max_tokens is dropped (too long)."""
    tokenizer = llm.tokenizer
    turn = open_user_turn(tokenizer)
    ids = tokenizer.encode(turn.prefix, add_special_tokens=False)
    markers = template_markers(tokenizer)
    dedup = Deduplicator()
    kept: list[Prompt] = []
    asked = 0
    for _ in range(max_rounds):
        if len(kept) >= n:
            break
        count = max(16, 2 * (n - len(kept)))
        requests = [(ids, _params(turn, temperature, max_tokens, seed + asked + i)) for i in range(count)]
        asked += count
        outs = run_requests(llm, requests, deadline, progress, desc="magpie")
        for i in sorted(outs):
            text = _written_turn(tokenizer, outs[i], turn)
            if text is not None and rejection(text, markers) is None and dedup.add(text):
                kept.append(Prompt("magpie", text, True))
        if len(outs) < count:  # the deadline passed
            break
    return kept[:n]


def follow_up_prompts(
    llm: LLM,
    answered: list[Sequence],
    seed: int = 0,
    temperature: float = 1.0,
    max_tokens: int = 128,
    deadline: float | None = None,
    progress: bool = False,
) -> list[Prompt]:
    """Two-turn prompts: for each answered chat prompt (a Sequence from regenerate, which keeps its prompt), the
    target writes the next user turn the same way; those that pass rejection() come back, with the exchange as their
    history. Not de-duplicated: the same follow-up ("Can you give an example?") after different exchanges differs."""
    tokenizer = llm.tokenizer
    markers = template_markers(tokenizer)
    turns: list[tuple[Prompt, tuple[Message, ...], OpenTurn]] = []
    for s in answered:
        if s.prompt is None or not s.prompt.chat:
            continue
        answer = tokenizer.decode(s.tokens[s.num_prompt_tokens :], skip_special_tokens=True).strip()
        history = (*s.prompt.messages(), {"role": "assistant", "content": answer})
        turns.append((s.prompt, history, open_user_turn(tokenizer, history)))
    requests = [
        (tokenizer.encode(turn.prefix, add_special_tokens=False), _params(turn, temperature, max_tokens, seed + i))
        for i, (_, _, turn) in enumerate(turns)
    ]
    outs = run_requests(llm, requests, deadline, progress, desc="follow-ups")
    prompts = []
    for i in sorted(outs):
        first, history, turn = turns[i]
        text = _written_turn(tokenizer, outs[i], turn)
        if text is not None and rejection(text, markers) is None:
            prompts.append(Prompt(f"{first.source}-follow-up", text, True, history))
    return prompts


def _params(turn: OpenTurn, temperature: float, max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        seed=seed,
        stop_token_ids=[turn.stop_token_id],
        output_kind="final_only",
    )


def _written_turn(tokenizer: Any, out: CompletionOutput, turn: OpenTurn) -> str | None:
    """The user's text, special tokens kept (so that the filter sees them); None when the turn did not end (cut at
    max_tokens) or ended on another stop (the engine's end of sequence, where it differs from the turn's end)."""
    if out.finish_reason != "stop" or not out.token_ids or out.token_ids[-1] != turn.stop_token_id:
        return None
    return tokenizer.decode(out.token_ids[:-1], skip_special_tokens=False).strip()
