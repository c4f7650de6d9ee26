"""SamplingParams.prompt_logprobs (vLLM's): every prompt token's logprob given the ones before it, its rank and the
top N, equal to transformers' (fp32), across prompt chunks, and never cut short by a prefix-cache hit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dspark import LLM, SamplingParams
from dspark.errors import ConfigError


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


def _reference(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def test_prompt_logprobs_equal_transformers_across_chunks_and_cache_hits(model_dir: Path) -> None:
    # 8-token steps: the 37-token prompt is prefilled in 5 chunks. Prefix caching is on (the default).
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_batched_tokens=8)
    prompt = [(7 * i + 3) % 200 + 10 for i in range(37)]
    reference = _reference(model_dir, prompt)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=2)
    # The first run fills the prefix cache; the second would hit it, and must compute every position anyway.
    runs = [llm.generate([prompt], params)[0], *llm.generate([prompt, prompt], [plain, params])[1:]]
    for out in runs:
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        for p in range(1, len(prompt)):
            entry, row = entries[p], reference[p - 1]
            assert entry is not None
            token = entry[prompt[p]]
            assert token.logprob == pytest.approx(row[prompt[p]].item(), abs=1e-4)
            assert token.rank == int((row > row[prompt[p]]).sum()) + 1
            top = [tid for tid, lp in entry.items() if lp.rank <= 3]
            assert sorted(top) == sorted(row.topk(3).indices.tolist())
            assert all(lp.decoded_token is not None for lp in entry.values())
    assert runs[0].outputs[0].token_ids == runs[1].outputs[0].token_ids
    assert llm.generate([prompt], plain)[0].prompt_logprobs is None  # not asked: not computed


def test_prompt_logprobs_zero_top_and_a_one_token_prompt(model_dir: Path) -> None:
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert [list(e) for e in out.prompt_logprobs[1:] if e is not None] == [[6], [7]]  # the prompt's tokens alone
    assert llm.generate([[5]], SamplingParams(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs == [None]
    with pytest.raises(ConfigError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_prompt_logprobs_survive_preemption(model_dir: Path) -> None:
    # 10 blocks of 16 tokens hold one request's 120 tokens, not two: one is preempted and computed again, and its
    # prompt logprobs still hold each prompt token's entry once. (Whether the preemption falls mid-prompt depends on
    # the schedule; the core keeps only entries past those it has, wherever the chunks of the recompute end.)
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=10, max_num_batched_tokens=24)
    prompts = [[(5 * i + 7 * j) % 200 + 10 for i in range(50)] for j in range(2)]
    params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for prompt, out in zip(prompts, outs, strict=True):
        reference = _reference(model_dir, prompt)
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt)
        for p in range(1, len(prompt)):
            assert entries[p] is not None
            assert entries[p][prompt[p]].logprob == pytest.approx(reference[p - 1][prompt[p]].item(), abs=1e-4)
