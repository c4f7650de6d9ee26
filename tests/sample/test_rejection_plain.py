"""verify_plain (verification decided on the device in batched kernels) against verify() (decided row by row on the
host) over the Sampler's distributions: the same tokens, case by case, for ragged batches of greedy and sampled
requests under both methods."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.config import GREEDY_BELOW
from dspark.models.loader import load_config
from dspark.sample.ops import SamplingRow, logits_to_probs
from dspark.sample.random import inverse_cdf, uniform
from dspark.sample.rejection import VerifyRow, verify, verify_plain
from dspark.speculative.drafters.dspark.checkpoint import random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig
from dspark.worker import model_runner

V = 64


def _row(temperature: float, seed: int, counter: int) -> SamplingRow:
    return SamplingRow(temperature, 0, 1.0, 0.0, seed, counter, [], [])


def _case(rng: random.Random, gen: torch.Generator, method: str) -> tuple:
    """A ragged batch: per request a temperature (0 = greedy), 0..5 drafts, logits peaked enough that drafts are
    accepted often, and drafts that are the target's token, a draft sample or a random token."""
    num_reqs = rng.randint(1, 6)
    # around GREEDY_BELOW (1e-5) too: greedy below it, sampled from it on
    temps = [rng.choice([0.0, 0.0, 0.5, 1.0, 1.7, 9.99e-6, 1e-5, 1.0000001e-5]) for _ in range(num_reqs)]
    lens = [rng.randint(0, 5) for _ in range(num_reqs)]
    logits = torch.randn(sum(lens) + num_reqs, V, generator=gen) * rng.choice([1.0, 3.0, 8.0])
    q_logits = logits[: max(1, sum(lens))] + torch.randn(max(1, sum(lens)), V, generator=gen)
    q = torch.softmax(q_logits, dim=-1)[: sum(lens)]
    rows, samp, t_row, d_row = [], [], 0, 0
    for r in range(num_reqs):
        seed = rng.randint(-(2**63), 2**63 - 1)
        first = rng.randint(0, 500)
        drafts = []
        for j in range(lens[r]):
            kind = rng.random()
            if kind < 0.5:
                tok = int(logits[t_row + j].argmax())
            elif kind < 0.85:
                tok = inverse_cdf(q[d_row + j], uniform(seed, first + j, stream=9))
            else:
                tok = rng.randrange(V)
            drafts.append(tok)
        greedy = temps[r] < GREEDY_BELOW
        if greedy:  # as the runner passes them: greedy rows' drafts have no distribution
            q[d_row : d_row + lens[r]] = 0.0
        rows.append(VerifyRow(seed, first, drafts, greedy))
        samp += [_row(temps[r], seed, first + j) for j in range(lens[r] + 1)]
        t_row += lens[r] + 1
        d_row += lens[r]
    draft_probs = q if method == "probabilistic" and not all(r.greedy for r in rows) else None
    return logits, draft_probs, rows, samp, temps


def _expected(logits: torch.Tensor, draft_probs, rows, samp, method: str) -> list[list[int]]:
    return verify(logits_to_probs(logits, samp), draft_probs, rows, method)


def _emitted(logits: torch.Tensor, draft_probs, rows, temps, method: str) -> list[list[int]]:
    accepted, last = verify_plain(logits, draft_probs, rows, temps, method)
    return [[*r.draft_tokens[:a], t] for r, a, t in zip(rows, accepted.tolist(), last.tolist(), strict=True)]


@pytest.mark.parametrize("method", ["probabilistic", "strict"])
def test_same_tokens_as_verify(method: str) -> None:
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    num_partial = num_corrected = num_sampled_corrected = num_bonus = 0
    for _ in range(150):
        logits, draft_probs, rows, samp, temps = _case(rng, gen, method)
        want = _expected(logits, draft_probs, rows, samp, method)
        assert _emitted(logits, draft_probs, rows, temps, method) == want
        for r, out in zip(rows, want, strict=True):
            num_partial += 0 < len(out) - 1 < len(r.draft_tokens)
            num_corrected += len(out) - 1 < len(r.draft_tokens)
            num_sampled_corrected += not r.greedy and len(out) - 1 < len(r.draft_tokens)
            num_bonus += not r.greedy and len(out) == len(r.draft_tokens) + 1
    # the cases reach every branch: drafts accepted in part, rejections corrected (by a residual draw under
    # probabilistic verification, by the plain draw under strict), sampled bonus tokens
    assert num_partial > 20 and num_corrected > 100 and num_sampled_corrected > 50 and num_bonus > 50


def test_an_empty_residual_draws_from_the_target() -> None:
    """A rejected draft where p = q (both zero at the draft): max(p - q, 0) is empty, and the correction is drawn from
    p itself, as verify() draws it."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    logits[:, 10:20] = float("-inf")  # p = 0 there
    p = torch.softmax(logits, dim=-1)
    rows = [VerifyRow(seed, 4, [12, 15]) for seed in range(20)]  # drafts where both p and q are 0: always rejected
    tp, dp, lg = torch.cat([p] * 20), torch.cat([p[:2]] * 20), torch.cat([logits] * 20)
    want = verify(tp, dp, rows)
    assert all(len(o) == 1 and not 10 <= o[0] < 20 for o in want)
    assert _emitted(lg, dp, rows, [1.0] * 20, "probabilistic") == want


def test_padding_rows_are_ignored() -> None:
    """The runner's logits may carry padding rows past the verified ones."""
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    logits, draft_probs, rows, samp, temps = _case(rng, gen, "probabilistic")
    padded = torch.cat([logits, torch.randn(5, V, generator=gen)])
    assert _emitted(padded, draft_probs, rows, temps, "probabilistic") == _expected(
        logits, draft_probs, rows, samp, "probabilistic"
    )


def test_a_request_does_not_depend_on_its_batch() -> None:
    """Each request of a ragged batch alone gives what it gave in the batch: the batch's index arithmetic (offsets,
    padding positions, the residual rows). On CPU draws go row by row; on CUDA the rows are drawn in batches, which
    test_gpu.py checks against verify()."""
    rng, gen = random.Random(11), torch.Generator().manual_seed(11)
    for _ in range(30):
        logits, draft_probs, rows, _, temps = _case(rng, gen, "probabilistic")
        together = _emitted(logits, draft_probs, rows, temps, "probabilistic")
        t_row = d_row = 0
        for r, row in enumerate(rows):
            n = len(row.draft_tokens)
            q = None if draft_probs is None else draft_probs[d_row : d_row + n]
            alone = _emitted(logits[t_row : t_row + n + 1], q, [row], [temps[r]], "probabilistic")
            assert alone[0] == together[r]
            t_row += n + 1
            d_row += n


def test_bad_arguments() -> None:
    logits = torch.zeros(3, V)
    with pytest.raises(ValueError, match="method"):
        verify_plain(logits, None, [VerifyRow(0, 0, [1])], [1.0], "magic")
    with pytest.raises(ValueError, match="draft distributions"):
        verify_plain(logits, None, [VerifyRow(0, 0, [1])], [1.0], "probabilistic")
    with pytest.raises(ValueError, match="logits has 3 rows, the drafts need 5"):
        verify_plain(logits, None, [VerifyRow(0, 0, [1, 2, 3, 4], greedy=True)], [0.0], "strict")
    with pytest.raises(ValueError, match="draft_probs has 1 rows, the drafts need 2"):
        verify_plain(logits, torch.zeros(1, V), [VerifyRow(0, 0, [1, 2])], [1.0], "probabilistic")
    with pytest.raises(ValueError, match="2 temperatures for 1 requests"):
        verify_plain(logits, None, [VerifyRow(0, 0, [1], greedy=True)], [0.0, 1.0], "strict")


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory: pytest.TempPathFactory, tiny_model_dirs: dict[str, Path]) -> Path:
    cfg = DSparkConfig.for_target(load_config(tiny_model_dirs["llama"]), block_size=4, num_taps=1, markov_rank=4)
    return save_drafter(random_drafter(cfg, seed=1), tmp_path_factory.mktemp("drafter"))


@pytest.mark.parametrize("method", ["dspark", "ngram"])
def test_engine_emits_the_row_by_row_tokens(
    method: str, tiny_model_dirs: dict[str, Path], tiny_drafter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole requests through the engine with verify_plain and with verify() (ModelRunner.plain_verify off): the same
    tokens, for greedy and seeded sampled requests side by side (probabilistic verification for the DSpark drafter,
    strict for n-gram), and drafts were accepted on the way."""
    spec: dict[str, object] = {"method": method, "num_speculative_tokens": 4, "enable_adaptive_verification": False}
    if method == "dspark":
        spec["model"] = str(tiny_drafter)
    else:
        spec["prompt_lookup_max"] = 2
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6] * 2, [100 + i for i in range(20)], [9, 9, 9, 9]]
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=40, ignore_eos=True)
        for t, s in ((0.0, None), (0.8, 3), (1.3, -7))
    ]
    outputs, accepted = [], []
    calls = [0]

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return verify_plain(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(model_runner, "verify_plain", counted)
    for plain in (True, False):
        calls[0] = 0
        llm = LLM(
            model=str(tiny_model_dirs["llama"]),
            dtype="float32",
            num_kv_blocks=64,
            max_model_len=256,
            speculative_config=spec,
        )
        llm.engine.runner.plain_verify = plain
        outs = llm.generate([p for p in prompts for _ in params], [q for _ in prompts for q in params])
        outputs.append([o.outputs[0].token_ids for o in outs])
        accepted.append(llm.engine.get_metrics()["spec_decode_num_accepted_tokens"])
        assert (calls[0] > 0) == plain  # the path asked for is the path taken
    assert outputs[0] == outputs[1]
    assert accepted[0] == accepted[1] > 0
