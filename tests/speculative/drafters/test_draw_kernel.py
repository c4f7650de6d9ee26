"""The drafter's fused draw (draw_kernel.py) against its torch twin.

On CPU the kernel runs under the Triton interpreter. TRITON_INTERPRET=1 must be set before triton decorates a kernel
and would turn every kernel of the process into an interpreted one, so those cases run in one subprocess (this file
run as a script) and each test reads its case's verdict. With CUDA the same cases run the compiled kernel.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import pytest
import torch

from dspark.config import GREEDY_BELOW
from dspark.sample.ops import softmax_temperatures, temperature_probs
from dspark.sample.random import inverse_cdf_rows
from dspark.speculative.drafters.dspark import draw_kernel
from dspark.speculative.drafters.dspark.confidence import ConfidenceHead
from dspark.speculative.drafters.dspark.markov import MarkovHead, sample_block_with
from helpers import interpreted_verdicts, run_interpreted

pytest.importorskip("triton")


def _inputs(
    num_rows: int, vocab: int, k: int, seed: int, temperatures: list[float], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(num_rows, k, vocab, generator=g) * 3  # a block's logits: position j's rows are strided
    correction = torch.randn(num_rows, vocab, generator=g)
    temps = torch.tensor(softmax_temperatures(temperatures), dtype=torch.float32)
    greedy = torch.tensor([t < GREEDY_BELOW for t in temperatures])
    u = torch.rand(num_rows, k, generator=g, dtype=torch.float64)  # position j's uniforms: a strided column
    return base.to(device), correction.to(device), temps.to(device), greedy.to(device), u.to(device)


def check_distribution_and_draw(device: torch.device, vocab: int, one_hot_greedy: bool) -> None:
    """Each row's distribution is the twin's softmax at its temperature (to fp32 rounding; greedy rows one-hot, or
    their softmax), and its draft is exactly the inverse CDF of the distribution the kernel wrote at the row's
    uniform (greedy rows: the argmax). Vocabularies below, at and past one block, with a ragged last block."""
    temperatures = [1.0, 0.0, 0.7, 1.3, 0.0, 0.5]
    for seed in range(2):
        base, correction, temps, greedy, u = _inputs(len(temperatures), vocab, 2, seed, temperatures, device)
        for j in range(2):
            for corr in (correction, None):
                logits = base[:, j] if corr is None else base[:, j] + corr
                top = logits.argmax(-1)
                x, q = draw_kernel.draw_position(
                    base[:, j], corr, temps, greedy, u[:, j], one_hot_greedy=one_hot_greedy
                )
                want = temperature_probs(logits, temps, greedy if one_hot_greedy else None, top)
                torch.testing.assert_close(q, want, rtol=2e-5, atol=1e-7)
                assert torch.equal(x, torch.where(greedy, top, inverse_cdf_rows(q, u[:, j])))
                assert bool((q.gather(1, x[:, None]) > 0).all())


def check_ties_and_zero_probabilities(device: torch.device) -> None:
    """The argmax of tied maxima is the first (torch's); a uniform at the top of [0, 1) draws the last token of
    positive probability, never one of the zero-probability tokens after it, nor one before the first positive one."""
    vocab = 5000
    base = torch.full((3, vocab), -30.0)
    base[:, 4100:] = float("-inf")  # the last block's tail has probability 0
    base[:, :7] = float("-inf")  # and so does the first block's head
    base[0, 10] = base[0, 2000] = base[0, 2058] = base[0, 4099] = 5.0  # tied maxima, two in one lane (2048 apart)
    base[1, 4000:4100] = 1.0
    base[2, 9] = 1.0
    base = base.to(device)
    temps = torch.tensor([1.0, 1.0, GREEDY_BELOW], dtype=torch.float32, device=device)
    greedy = torch.tensor([False, False, True], device=device)
    for u_value, want in [(1.0 - 2.0**-53, [4099, 4099, 9]), (0.0, [7, 7, 9])]:
        u = torch.full((3,), u_value, dtype=torch.float64, device=device)
        x, q = draw_kernel.draw_position(base, None, temps, greedy, u)
        assert x.tolist() == want, u_value
        assert q[2].tolist() == [1.0 if i == 9 else 0.0 for i in range(vocab)]
    x, _ = draw_kernel.draw_position(base, None, temps, torch.ones_like(greedy), u)
    assert x.tolist() == [10, 4000, 9]


def check_draws_follow_the_distribution(device: torch.device) -> None:
    """Over many uniforms, the kernel's drafts land on each token as often as the distribution says (chi-square, a
    generous bound): a check of the draw that does not lean on the twin."""
    vocab, n = 16, 600
    g = torch.Generator().manual_seed(7)
    base = (torch.randn(1, vocab, generator=g) * 2).expand(n, vocab).contiguous().to(device)
    u = torch.rand(n, generator=g, dtype=torch.float64).to(device)
    x, q = draw_kernel.draw_position(
        base, None, torch.ones(n, device=device), torch.zeros(n, dtype=torch.bool, device=device), u
    )
    expected = q[0].double().cpu() * n
    observed = torch.bincount(x.cpu(), minlength=vocab).double()
    kept = expected >= 5
    chi2 = float((((observed - expected) ** 2) / expected)[kept].sum())
    assert chi2 < 2.0 * int(kept.sum()) + 30, chi2


def check_block(device: torch.device, into_buffer: bool) -> None:
    """sample_block_with with the kernel drafts the tokens the torch loop drafts, with the same distributions to fp32
    rounding and the same confidences: padding rows, greedy rows among sampled ones, the Markov head feeding each
    draft to the next position; returned, or written position by position (probs_out)."""
    vocab, rank, hidden, k, num_reqs, num_pad = 3000, 8, 16, 4, 5, 7
    torch.manual_seed(0)
    head, confidence = MarkovHead(vocab, rank).to(device), ConfidenceHead(hidden, rank).to(device)
    base = (torch.randn(num_pad, k, vocab) * 2).to(device)
    h = torch.randn(num_pad, k, hidden).to(device)
    anchors = torch.randint(0, vocab, (num_pad,)).to(device)
    temperatures = [1.0, 0.0, 0.8, 1.2, 0.0]
    temps = torch.tensor(softmax_temperatures(temperatures), dtype=torch.float32, device=device)
    greedy = torch.tensor([t < GREEDY_BELOW for t in temperatures], device=device)
    u = torch.rand(num_reqs, k, dtype=torch.float64).to(device)
    enabled = draw_kernel.enabled
    runs = []
    try:
        for fused in (False, True):
            draw_kernel.enabled = lambda d, fused=fused: fused  # type: ignore[assignment]
            out = torch.full((k, num_reqs, vocab), float("nan"), device=device) if into_buffer else None
            with torch.inference_mode():
                drafts = sample_block_with(base, h, anchors, head, confidence, temps, greedy, u, probs_out=out)
            runs.append((drafts, out))
    finally:
        draw_kernel.enabled = enabled  # type: ignore[assignment]
    (twin, twin_out), (kernel, kernel_out) = runs
    assert torch.equal(kernel.tokens, twin.tokens)
    assert kernel.confidence_logits is not None and twin.confidence_logits is not None
    assert torch.equal(kernel.confidence_logits, twin.confidence_logits)
    if into_buffer:
        assert kernel.probs is None and twin.probs is None
        torch.testing.assert_close(kernel_out, twin_out, rtol=2e-5, atol=1e-7)
    else:
        assert kernel.probs is not None and twin.probs is not None
        torch.testing.assert_close(kernel.probs, twin.probs, rtol=2e-5, atol=1e-7)


CASES: dict[str, Callable[[torch.device], None]] = {
    **{
        f"distribution-v{v}-{'one_hot' if o else 'softmax'}": (lambda d, v=v, o=o: check_distribution_and_draw(d, v, o))
        for v in (1000, 2048, 4099)
        for o in (True, False)
    },
    "ties-and-zeros": check_ties_and_zero_probabilities,
    "chi-square": check_draws_follow_the_distribution,
    "block-returned": lambda d: check_block(d, False),
    "block-into-buffer": lambda d: check_block(d, True),
}


@pytest.fixture(scope="module")
def interpreted(request: pytest.FixtureRequest) -> dict[str, str]:
    """Verdicts of the selected interpreter cases, all computed in one subprocess (one import of torch and triton)."""
    return interpreted_verdicts(request, "test_interpreted_draw_matches_the_twin", __file__)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_draw_matches_the_twin(interpreted: dict[str, str], name: str) -> None:
    assert interpreted[name] == "ok", interpreted[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_draw_matches_the_twin(name: str) -> None:
    assert draw_kernel.enabled(torch.device("cuda")), "on CUDA drafted positions draw through the kernel"
    CASES[name](torch.device("cuda"))


@pytest.mark.parametrize("has_correction", [True, False])
def test_the_kernel_compiles_for_hopper(has_correction: bool) -> None:
    """Triton compiles the kernel to an sm_90 binary here, without a GPU: the interpreter above checks its logic,
    this its types and loops as the compiler sees them (it accepts code that the interpreter would not, and back)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature = {
        "base_ptr": "*fp32",
        "base_stride": "i64",
        "corr_ptr": "*fp32",
        "corr_stride": "i64",
        "temp_ptr": "*fp32",
        "greedy_ptr": "*i1",
        "u_ptr": "*fp64",
        "u_stride": "i64",
        "q_ptr": "*fp32",
        "x_ptr": "*i64",
        "V": "i32",
        "HAS_CORR": "constexpr",
        "ONE_HOT_GREEDY": "constexpr",
        "BLOCK": "constexpr",
    }
    constants = {"HAS_CORR": has_correction, "ONE_HOT_GREEDY": has_correction, "BLOCK": draw_kernel.BLOCK}
    binary = compile(
        ASTSource(fn=draw_kernel._kernel(), signature=signature, constexprs=constants), GPUTarget("cuda", 90, 32)
    )
    assert binary.asm["cubin"]


def test_bad_inputs_are_refused() -> None:
    """Checked before any launch: the wrong dtypes, strided vocabularies, a misshapen output."""
    base = torch.zeros(2, 100)
    temps, greedy, u = torch.ones(2), torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="fp32"):
        draw_kernel.draw_position(base.double(), None, temps, greedy, u)
    with pytest.raises(ValueError, match="contiguous rows"):
        draw_kernel.draw_position(base.t().contiguous().t(), None, temps, greedy, u)
    with pytest.raises(ValueError, match="uniforms fp64"):
        draw_kernel.draw_position(base, None, temps, greedy, u.float())
    with pytest.raises(ValueError, match="out must be"):
        draw_kernel.draw_position(base, None, temps, greedy, u, out=torch.empty(100, 2).t())


def test_only_cuda_draws_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU keeps the twin; DSPARK_FUSED_DRAW=0 keeps it on CUDA too (for comparison)."""
    assert not draw_kernel.enabled(torch.device("cpu"))
    monkeypatch.setenv("DSPARK_FUSED_DRAW", "0")
    assert not draw_kernel.enabled(torch.device("cuda"))


if __name__ == "__main__":
    print(json.dumps(run_interpreted(lambda name: CASES[name](torch.device("cpu")), sys.argv[1:])))
