"""A cheap automatic check for degenerate completions: loops, stutters and answers that never end.

A broken sampler or a lossy speculative path rarely changes a model's answers subtly: it makes them loop. Three
signals, each with a threshold in DegenerationConfig:
- repeated n-grams: the fraction of a text's word n-grams that already occurred earlier in it. Prose repeats few
  4-grams (a few percent); a text stuck in a loop repeats nearly all of them. Not judged below `min_words`.
- the longest repeated run: the longest stretch where one pattern of 1..max_period words repeats back to back
  ("the the the ...", or one sentence said again and again), as the number of words it spans.
- runaway length: the request stopped at max_tokens (finish_reason "length") instead of ending itself.
An empty completion is flagged too. Words are runs of letters and digits, or runs of punctuation, lower-cased.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dspark.errors import ConfigError

_WORD = re.compile(r"\w+|[^\w\s]+")


@dataclass(frozen=True)
class DegenerationConfig:
    ngram: int = 4  # n of the repeated n-gram ratio
    max_ngram_ratio: float = 0.4  # flag above this fraction of repeated n-grams
    min_words: int = 40  # shorter texts are not judged by the ratio: a few repeats there are noise
    max_period: int = 16  # longest pattern, in words, the run search looks for
    max_run_words: int = 30  # flag a repeated run spanning at least this many words

    def __post_init__(self) -> None:
        for name in ("ngram", "min_words", "max_period", "max_run_words"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "a positive integer")
        if not 0.0 < self.max_ngram_ratio < 1.0:
            raise ConfigError("max_ngram_ratio", self.max_ngram_ratio, "a fraction in (0, 1)")


@dataclass(frozen=True)
class Degeneration:
    num_words: int
    ngram_ratio: float
    run_words: int  # words spanned by the longest repeated run (0: none)
    run_period: int  # words in its repeating pattern
    reasons: dict[str, str] = field(default_factory=dict)  # code -> why; empty: not flagged

    @property
    def flagged(self) -> bool:
        return bool(self.reasons)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def repeated_ngram_ratio(tokens: list[str], n: int) -> float:
    """The fraction of the n-grams that occurred earlier in the text (0 when there are none)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def longest_repeated_run(tokens: list[str], max_period: int) -> tuple[int, int]:
    """(words spanned, period) of the longest stretch made of one pattern repeated back to back, at least twice;
    (0, 0) when there is none."""
    best = (0, 0)
    for period in range(1, max_period + 1):
        streak = 0  # positions i in a row with tokens[i] == tokens[i + period]
        for i in range(len(tokens) - period):
            streak = streak + 1 if tokens[i] == tokens[i + period] else 0
            span = streak + period
            if streak >= period and span > best[0]:  # streak >= period: at least two whole copies
                best = (span, period)
    return best


def check(text: str, finish_reason: str | None = None, config: DegenerationConfig | None = None) -> Degeneration:
    config = config or DegenerationConfig()
    tokens = words(text)
    ratio = repeated_ngram_ratio(tokens, config.ngram)
    run_words, period = longest_repeated_run(tokens, config.max_period)
    reasons = {}
    if not text.strip():
        reasons["empty"] = "the completion is empty"
    if len(tokens) >= config.min_words and ratio > config.max_ngram_ratio:
        reasons["repeated-ngrams"] = (
            f"{ratio:.0%} of its {config.ngram}-grams repeat earlier ones (limit {config.max_ngram_ratio:.0%})"
        )
    if run_words >= config.max_run_words:
        reasons["repeated-run"] = f"a {period}-word pattern repeats back to back over {run_words} words"
    if finish_reason == "length":
        reasons["runaway-length"] = "it hit max_tokens without finishing"
    return Degeneration(len(tokens), ratio, run_words, period, reasons)
