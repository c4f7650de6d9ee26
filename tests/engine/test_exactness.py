"""Logits and greedy tokens equal Hugging Face transformers' (fp32, CPU), in batch-invariant mode and in the default
(fast) one: tiny random models and SmolLM2-135M. In bf16 the fast path stays within a documented tolerance
(docs/numerics.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark import LLM, SamplingParams
from helpers import FAMILIES

# The default (fast) CPU path in bf16 against transformers in fp32 (docs/numerics.md): logits within this fraction of
# the row's largest logit, and the argmax agreeing at least this often over the positions checked.
BF16_LOGIT_TOL = 0.06
BF16_ARGMAX_AGREEMENT = 0.90
CHATS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a ten-year-old.",
]


def _capture_logits(llm: LLM) -> list[torch.Tensor]:
    """Record the first sampled row's logits at every step (single-request runs)."""
    seen: list[torch.Tensor] = []
    model = llm.engine.model
    original = model.compute_logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        seen.append(logits[0].clone())
        return logits

    model.compute_logits = spy  # type: ignore[method-assign]
    return seen


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _check_against_hf(llm: LLM, hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> float:
    worst = 0.0
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for prompt in prompts:
        seen = _capture_logits(llm)
        out = llm.generate([prompt], params)[0].outputs[0]
        with torch.inference_mode():
            full = torch.tensor([prompt + out.token_ids[:-1]])
            ref_logits = hf(full).logits[0, len(prompt) - 1 :].float()
        # Teacher-forced: if every step's argmax agrees, transformers' greedy decoding yields the same tokens.
        assert out.token_ids == ref_logits.argmax(-1).tolist(), f"greedy tokens differ for prompt {prompt[:8]}..."
        ours = torch.stack(seen[-new_tokens:])
        err = _relative_error(ours, ref_logits)
        assert err < 1e-4, f"logits differ from transformers: relative error {err:.2e}"
        worst = max(worst, err)
    return worst


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_match_transformers(family: str, invariant: bool, tiny_model_dirs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[family], dtype=torch.float32).eval()
    llm = LLM(
        model=str(tiny_model_dirs[family]),
        dtype="float32",
        max_model_len=512,
        num_kv_blocks=128,
        batch_invariant=invariant,
    )
    g = torch.Generator().manual_seed(1)
    # Lengths straddle the attention tile (256) and the block size (16).
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 17, 300)]
    _check_against_hf(llm, hf, prompts, new_tokens=24)


@pytest.mark.slow
@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_smollm2_matches_transformers(smollm2_path: Path, invariant: bool) -> None:
    from transformers import AutoModelForCausalLM

    # transformers dequantizes and un-permutes the GGUF with its own code: an independent reference for ours.
    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
    llm = LLM(dtype="float32", max_model_len=1024, batch_invariant=invariant)
    prompts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    worst = _check_against_hf(llm, hf, prompts, new_tokens=64)
    print(f"SmolLM2-135M fp32: worst relative logit error {worst:.2e}")


@pytest.mark.slow
def test_smollm2_bf16_fast_path_within_tolerance(smollm2_path: Path) -> None:
    """bf16 in the default mode, teacher-forced on its own greedy tokens, against transformers in fp32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
    llm = LLM(dtype="bfloat16", max_model_len=1024, batch_invariant=False)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    errors, agree = [], []
    for chat in CHATS:
        prompt = llm.apply_chat_template([{"role": "user", "content": chat}])
        seen = _capture_logits(llm)
        out = llm.generate([prompt], params)[0].outputs[0]
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :].float()
        ours = torch.stack(seen[-64:]).float()
        assert ours.argmax(-1).tolist() == out.token_ids  # the captured rows are the ones it decoded from
        errors.append(((ours - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item())
        agree.append((ours.argmax(-1) == ref.argmax(-1)).float())
    agreement = torch.cat(agree).mean().item()
    print(f"SmolLM2-135M bf16, fast: worst relative logit error {max(errors):.3f}, argmax agreement {agreement:.3f}")
    assert max(errors) < BF16_LOGIT_TOL
    assert agreement >= BF16_ARGMAX_AGREEMENT
