"""The prompts `dspark bench serve` sends: random ones of a given length, or prompts read from a JSON-lines file.

- random: with a tokenizer (--tokenizer, else --model when it is a local path or a dspark alias), each prompt is
  --random-input-len token ids drawn uniformly from the vocabulary (special tokens left out) and decoded; decoding and
  the server's encoding again can move the count by a few tokens, so the result JSON reports the server's count.
  Without a tokenizer each prompt is that many words drawn from WORDS, short common English words that are one token
  each in the usual BPE vocabularies (so the length is close to, not exactly, the requested one).
- jsonl, gsm8k, mt-bench: --dataset-path, each line's "prompt", else its first "turns" entry, else its "question"
  (GSM8K's test.jsonl, FastChat's or DeepSpec's MT-bench files all read as they are). The prompts are shuffled with
  --seed unless --disable-shuffle, and repeat when the file has fewer than --num-prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.errors import ConfigError, DSparkError
from dspark.utils.jsonl import read_jsonl_prompts

DATASETS = ("random", "jsonl", "gsm8k", "mt-bench")

WORDS = (
    "the of and to in is was for on that with as by at from his her they this had not are but have one all were "
    "when we there can an which their said if do will each about how up out them then she many some so these would "
    "other into has more two like him see time could no make than first been its who now people my made over did "
    "down only way find use may water long little very after words called just where most know get through back "
    "much before go good new write our used me man too any day same right look think also around another came come "
    "work three must because does part even place well such here take why help put different away again off went "
    "old number great tell men say small every found still between name should home big give air line set own under "
    "read last never us left end along while might next sound below saw something thought both few those always "
    "show large often together asked house world going want school important until form food keep children feet "
    "land side without boy once animal life enough took four head above kind began almost live page got earth need "
    "far hand high year mother light country father let night picture being study second soon story since white"
).split()


@dataclass(frozen=True)
class ServePrompt:
    text: str
    prompt_len: int | None  # the client's token count, when it has a tokenizer
    output_len: int  # max_tokens of its request


def sample_prompts(
    dataset_name: str,
    num_prompts: int,
    *,
    dataset_path: str | None = None,
    tokenizer: Any | None = None,
    random_input_len: int = 1024,
    random_output_len: int = 128,
    output_len: int = 256,
    shuffle: bool = True,
    seed: int = 0,
) -> list[ServePrompt]:
    if num_prompts < 1:
        raise ConfigError("num_prompts", num_prompts, "a positive integer")
    if dataset_name == "random":
        return random_prompts(num_prompts, random_input_len, random_output_len, tokenizer, seed)
    if dataset_name not in DATASETS:
        raise ConfigError("dataset_name", dataset_name, f"one of {', '.join(DATASETS)}")
    if output_len < 1:
        raise ConfigError("output_len", output_len, "a positive integer")
    if dataset_path is None:
        raise ConfigError("dataset_path", None, f"a JSON-lines file of prompts for --dataset-name {dataset_name}")
    if not Path(dataset_path).is_file():
        raise ConfigError("dataset_path", dataset_path, "an existing JSON-lines file")
    texts = read_jsonl_prompts(Path(dataset_path))
    if shuffle:
        random.Random(seed).shuffle(texts)
    picked = [texts[i % len(texts)] for i in range(num_prompts)]
    return [ServePrompt(t, _count(tokenizer, t), output_len) for t in picked]


def random_prompts(
    num_prompts: int, input_len: int, output_len: int, tokenizer: Any | None, seed: int
) -> list[ServePrompt]:
    if input_len < 1:
        raise ConfigError("random_input_len", input_len, "a positive integer")
    if output_len < 1:
        raise ConfigError("random_output_len", output_len, "a positive integer")
    rng = random.Random(seed)
    if tokenizer is None:
        return [ServePrompt(" ".join(rng.choices(WORDS, k=input_len)), None, output_len) for _ in range(num_prompts)]
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    prompts = []
    for _ in range(num_prompts):
        text = tokenizer.decode(rng.choices(vocab, k=input_len))
        prompts.append(ServePrompt(text, _count(tokenizer, text), output_len))
    return prompts


def _count(tokenizer: Any | None, text: str) -> int | None:
    return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else None


def load_client_tokenizer(tokenizer: str | None, model: str) -> tuple[Any | None, str | None]:
    """(tokenizer, its id): --tokenizer, else the model when it names a local path or a dspark alias already in the
    cache (a client should not download a model unasked); (None, None) when the model is only a name the server
    knows."""
    from dspark.models.registry import ALIASES, cache_dir, resolve_model
    from dspark.models.tokenizer import load_tokenizer

    name = tokenizer or model
    alias = ALIASES.get(model.lower())
    cached_alias = alias is not None and (cache_dir() / model.lower() / alias.filename).is_file()
    if tokenizer is None and not cached_alias and not Path(model).expanduser().exists():
        return None, None
    try:
        return load_tokenizer(resolve_model(name)), name
    except DSparkError as e:
        if tokenizer is not None:
            raise ConfigError("tokenizer", tokenizer, f"a tokenizer dspark can load ({e})") from None
        return None, None
