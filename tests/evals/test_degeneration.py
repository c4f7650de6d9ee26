"""The degeneration check on crafted texts: loops and stutters are flagged, ordinary prose is not."""

from __future__ import annotations

import pytest

from dspark.errors import ConfigError
from dspark.evals.degeneration import DegenerationConfig, check, longest_repeated_run, repeated_ngram_ratio, words

PARAGRAPH = (
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into chemical energy. "
    "Inside the chloroplasts, chlorophyll absorbs sunlight, and that energy splits water molecules into oxygen, "
    "protons and electrons. The electrons travel along a chain of proteins that pumps protons across a membrane, "
    "and the resulting gradient drives the enzyme that makes ATP. In the Calvin cycle the plant then uses ATP and "
    "NADPH to fix carbon dioxide from the air into sugars, which feed the plant and, through food chains, nearly "
    "every other living thing. The oxygen released as a by-product is what most animals breathe, so the process "
    "matters twice over: it stores the energy of the sun and it keeps the atmosphere fit for life."
)


def test_a_normal_paragraph_is_not_flagged() -> None:
    result = check(PARAGRAPH, "stop")
    assert not result.flagged, result.reasons
    assert result.num_words > 100 and result.ngram_ratio < 0.1 and result.run_words < 10


def test_a_looping_text_is_flagged() -> None:
    text = "Sure! Here is the answer. " + "The answer is 42 because it is. " * 20
    result = check(text, "stop")
    assert set(result.reasons) == {"repeated-ngrams", "repeated-run"}
    assert result.ngram_ratio > 0.8 and result.run_period == 8 and result.run_words >= 150


def test_a_stutter_inside_prose_is_flagged_by_its_run() -> None:
    text = PARAGRAPH + " " + "the " * 40 + PARAGRAPH[:200]
    result = check(text, "stop")
    assert "repeated-run" in result.reasons and result.run_period == 1 and result.run_words >= 40


def test_runaway_length_and_empty() -> None:
    assert set(check(PARAGRAPH, "length").reasons) == {"runaway-length"}
    assert set(check("  ", "stop").reasons) == {"empty"}


def test_short_texts_are_not_judged_by_the_ratio() -> None:
    assert not check("yes yes yes no", "stop").flagged


def test_the_measures() -> None:
    assert words("Hello, World!! 42") == ["hello", ",", "world", "!!", "42"]
    assert repeated_ngram_ratio(list("abcabc"), 3) == pytest.approx(1 - 3 / 4)
    assert repeated_ngram_ratio(list("ab"), 3) == 0.0
    assert longest_repeated_run(list("xabababy"), 4) == (6, 2)
    assert longest_repeated_run(list("abcd"), 4) == (0, 0)


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_ngram_ratio"):
        DegenerationConfig(max_ngram_ratio=1.5)
    with pytest.raises(ConfigError, match="ngram"):
        DegenerationConfig(ngram=0)
