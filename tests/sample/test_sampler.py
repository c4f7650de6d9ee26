"""Sampler: exact greedy cases, seeded determinism whatever the batch, filter sets, distributions, penalties,
banned tokens and raw logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.sample.ops import SamplingRow, apply_penalties, logits_to_probs, temperature_probs
from dspark.sample.random import mix_seed, uniform, uniforms
from dspark.sample.sampler import Sampler

# Chi-square critical values at significance 1e-3 for 1..7 degrees of freedom. Draws are seeded, so a test that
# passes once passes always; the level only bounds how unlucky a correct sampler could have been.
CHI2_CRIT_1E3 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322]

# A known 8-token distribution, in scrambled order so no filter can rely on index order.
BASE_P = torch.tensor([0.05, 0.30, 0.02, 0.40, 0.10, 0.08, 0.03, 0.02], dtype=torch.float64)


def row(
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    counter: int = 0,
    **kw: object,
) -> SamplingRow:
    kw.setdefault("prompt_token_ids", [])
    kw.setdefault("output_token_ids", [])
    return SamplingRow(temperature, top_k, top_p, min_p, seed, counter, **kw)  # type: ignore[arg-type]


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return [r.token_id for r in Sampler()(logits, rows)]


def random_logits(num_rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=g) * scale


def test_greedy_is_argmax_whatever_the_filters() -> None:
    logits = random_logits(16, 3000, seed=1)
    rows = [row(temperature=0.0, seed=i, counter=i, top_k=5 * (i % 3), top_p=0.5 + 0.03 * i) for i in range(16)]
    assert sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(12, 3000, seed=2)
    for temperature in (0.3, 1.0, 5.0):
        rows = [row(temperature=temperature, top_k=1, seed=100 + i, counter=i) for i in range(12)]
        assert sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_seeded_sampling_is_independent_of_batch_composition_and_order() -> None:
    n, vocab = 20, 1000
    logits = random_logits(n, vocab, seed=3, scale=1.0)
    rows = [
        row(temperature=0.5 + 0.1 * i, top_k=[-1, 0, 50][i % 3], top_p=[1.0, 0.9][i % 2], seed=7 * i, counter=i)
        for i in range(n)
    ]
    together = sample(logits, rows)
    assert len(set(together)) > 10  # really random rows, not argmax everywhere

    alone = [sample(logits[i : i + 1], [rows[i]])[0] for i in range(n)]
    assert alone == together

    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    permuted = sample(logits[perm], [rows[i] for i in perm])
    assert permuted == [together[i] for i in perm]

    # Interleave unrelated rows and add padding rows full of garbage at the end.
    extra = random_logits(n, vocab, seed=4, scale=5.0)
    mixed_logits = torch.cat([torch.stack([logits, extra], dim=1).reshape(2 * n, vocab), torch.full((5, vocab), 1e4)])
    mixed_rows = [r for i in range(n) for r in (rows[i], row(seed=999, counter=i))]
    mixed = sample(mixed_logits, mixed_rows)
    assert mixed[0::2] == together

    assert sample(logits, rows) == together  # and simply repeatable


def test_counters_and_seeds_give_different_streams() -> None:
    vocab = 1000
    flat = torch.zeros(1, vocab)
    by_counter = sample(flat.repeat(200, 1), [row(seed=5, counter=c) for c in range(200)])
    by_seed = sample(flat.repeat(200, 1), [row(seed=s, counter=3) for s in range(200)])
    # 200 uniform draws from 1000 tokens: ~181 distinct expected; a shared stream would give 1.
    assert len(set(by_counter)) > 150
    assert len(set(by_seed)) > 150
    same = sample(flat.repeat(6, 1), [row(seed=5, counter=17)] * 6)
    assert same == [by_counter[17]] * 6


def test_mix_seed_is_a_deterministic_injective_looking_mix() -> None:
    values = {mix_seed(s, c) for s in range(100) for c in range(100)}
    assert len(values) == 100 * 100  # in particular (s, c) and (c, s) differ
    assert all(0 <= v < 2**63 for v in values)
    assert mix_seed(123, 4) == mix_seed(123, 4)
    for s in (-1, -(2**63), 2**63 - 1):
        assert 0 <= mix_seed(s, 0) < 2**63


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p", "allowed"),
    [
        (1.0, 2, 1.0, 0.0, {3, 1}),
        (1.0, 4, 1.0, 0.0, {3, 1, 4, 5}),
        (1.0, -1, 0.65, 0.0, {3, 1}),  # masses before: 0, .4 < .65, .7 >= .65
        (1.0, -1, 0.85, 0.0, {3, 1, 4, 5}),  # 0, .4, .7, .8 < .85; .88 >= .85
        (1.0, -1, 1.0, 0.22, {3, 1, 4}),  # threshold .22 * .4 = .088
        (1.0, -1, 1.0, 0.5, {3, 1}),
        (1.0, 3, 0.8, 0.0, {3, 1}),  # top-p over the renormalised top 3: .5, .375 -> .875 >= .8
        (2.0, -1, 0.6, 0.0, {3, 1, 4}),  # T=2 flattens first: .257, .223, .129 -> .609 >= .6
    ],
)
def test_filters_only_return_allowed_tokens(
    temperature: float, top_k: int, top_p: float, min_p: float, allowed: set[int]
) -> None:
    n = 2000
    logits = (BASE_P.log().float() + 1.7).repeat(n, 1)
    rows = [row(temperature, top_k, top_p, min_p, seed=11, counter=c) for c in range(n)]
    got = set(sample(logits, rows))
    assert got == allowed  # inside the set, and every allowed token is reachable


def chi_square(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    total = counts.sum().item()
    exp = expected_p * total
    support = expected_p > 0
    assert counts[~support].sum().item() == 0, f"tokens outside the support were sampled: {counts.tolist()}"
    return float((((counts[support] - exp[support]) ** 2) / exp[support]).sum())


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p", "allowed"),
    [
        (1.0, -1, 1.0, 0.0, set(range(8))),
        (0.5, -1, 1.0, 0.0, set(range(8))),
        (1.0, 3, 1.0, 0.0, {3, 1, 4}),
        (1.0, -1, 0.85, 0.0, {3, 1, 4, 5}),
        (1.0, 3, 0.8, 0.0, {3, 1}),
        (2.0, -1, 0.6, 0.0, {3, 1, 4}),
        (0.8, -1, 1.0, 0.1, {3, 1, 4, 5}),  # q = p^1.25: threshold .1 * q_max keeps q >= .0318
    ],
)
def test_sampled_distribution_matches_softmax_with_renormalised_filters(
    temperature: float, top_k: int, top_p: float, min_p: float, allowed: set[int]
) -> None:
    n = 12_000
    logits = (BASE_P.log().float() - 3.0).repeat(n, 1)
    rows = [row(temperature, top_k, top_p, min_p, seed=2024, counter=c) for c in range(n)]
    counts = torch.bincount(torch.tensor(sample(logits, rows)), minlength=8).double()

    q = BASE_P ** (1.0 / temperature)
    q = q / q.sum()
    mask = torch.zeros(8, dtype=torch.bool)
    mask[list(allowed)] = True
    expected = torch.where(mask, q, torch.zeros_like(q))
    expected = expected / expected.sum()

    crit = CHI2_CRIT_1E3[len(allowed) - 2]
    stat = chi_square(counts, expected)
    assert stat < crit, (stat, counts.tolist(), expected.tolist())
    # The test has power: the same draws are far from the plain softmax whenever the expected one differs from it.
    if temperature != 1.0 or len(allowed) < 8:
        exp_plain = BASE_P * n
        assert float(((counts - exp_plain) ** 2 / exp_plain).sum()) > 10 * crit


def test_penalties_follow_vllm_semantics_exactly() -> None:
    base = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0, 0.0, -0.5])
    prompt, output = [0, 1, 1], [2, 3, 3, 6]

    x = base.clone()
    apply_penalties(x, row(prompt_token_ids=prompt, output_token_ids=output, repetition_penalty=2.0))
    # Every token seen in prompt or output, once: positive / 2, negative * 2; zero stays zero.
    assert x.tolist() == [1.0, -4.0, 0.5, -2.0, 0.5, 3.0, 0.0, -0.5]

    x = base.clone()
    apply_penalties(x, row(prompt_token_ids=prompt, output_token_ids=output, frequency_penalty=0.5))
    # Output tokens only, times their count: 2 once, 3 twice, 6 once; prompt tokens untouched.
    assert x.tolist() == [2.0, -2.0, 0.5, -2.0, 0.5, 3.0, -0.5, -0.5]

    x = base.clone()
    apply_penalties(x, row(prompt_token_ids=prompt, output_token_ids=output, presence_penalty=0.75))
    assert x.tolist() == [2.0, -2.0, 0.25, -1.75, 0.5, 3.0, -0.75, -0.5]

    x = base.clone()
    apply_penalties(
        x,
        row(
            prompt_token_ids=prompt,
            output_token_ids=output,
            presence_penalty=-0.5,
            frequency_penalty=0.25,
            repetition_penalty=0.5,
        ),
    )
    # Repetition first (0.5 < 1 boosts seen tokens), then -(0.25 * count) + 0.5 on output tokens.
    assert x.tolist() == pytest.approx([4.0, -1.0, 2.0 - 0.25 + 0.5, -0.5 - 0.5 + 0.5, 0.5, 3.0, 0.25, -0.5])

    x = base.clone()
    apply_penalties(x, row(prompt_token_ids=prompt, output_token_ids=[], presence_penalty=1.0, frequency_penalty=1))
    assert x.tolist() == base.tolist()  # no output yet: nothing to penalise


def test_penalties_change_what_greedy_picks() -> None:
    logits = torch.tensor([[0.0, 2.5, 0.0, 3.0, 0.0]])
    assert sample(logits, [row(temperature=0.0, output_token_ids=[3])]) == [3]
    assert sample(logits, [row(temperature=0.0, output_token_ids=[3], frequency_penalty=0.6)]) == [1]
    assert sample(logits, [row(temperature=0.0, output_token_ids=[3, 3], frequency_penalty=0.3)]) == [1]
    assert sample(logits, [row(temperature=0.0, output_token_ids=[3, 3], presence_penalty=0.3)]) == [3]
    assert sample(logits, [row(temperature=0.0, prompt_token_ids=[3], repetition_penalty=1.3)]) == [1]
    # The penalties of one row never leak into another.
    rows = [row(temperature=0.0, output_token_ids=[3], presence_penalty=1.0), row(temperature=0.0)]
    assert sample(logits.repeat(2, 1), rows) == [1, 3]


def test_banned_tokens_are_never_sampled() -> None:
    n, vocab = 3000, 6
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.5, 0.0, 0.0]]).repeat(n, 1)
    banned = (0, 2)
    assert sample(logits[:1], [row(temperature=0.0, banned_token_ids=banned)]) == [1]
    assert sample(logits[:1], [row(top_k=1, banned_token_ids=banned)]) == [1]
    rows = [row(temperature=3.0, seed=9, counter=c, banned_token_ids=banned) for c in range(n)]
    got = set(sample(logits, rows))
    assert got == {1, 3, 4, 5}
    unbanned = set(sample(logits, [row(temperature=3.0, seed=9, counter=c) for c in range(n)]))
    assert unbanned == set(range(vocab))  # the ban, not the logits, keeps them out
    # With a penalty that would push banned tokens back up, they stay banned.
    rows = [
        row(temperature=3.0, seed=9, counter=c, banned_token_ids=banned, output_token_ids=[0], presence_penalty=-2.0)
        for c in range(300)
    ]
    assert not set(sample(logits[:300], rows)) & set(banned)


def test_logprobs_are_of_the_raw_distribution() -> None:
    n, vocab = 6, 500
    logits = random_logits(n + 2, vocab, seed=5)  # 2 padding rows
    logits[n:] = 1e4
    rows = [
        row(temperature=0.0, num_logprobs=5),
        row(temperature=0.7, seed=1, counter=0, num_logprobs=3, output_token_ids=[1, 2], repetition_penalty=1.5),
        row(temperature=2.0, seed=2, counter=4, top_p=0.5, num_logprobs=0),
        row(temperature=1.0, seed=3, counter=1),  # no logprobs for this one
        row(temperature=1.0, seed=4, counter=2, num_logprobs=20, presence_penalty=1.0, output_token_ids=[7]),
        row(temperature=0.0, num_logprobs=1, banned_token_ids=(int(logits[5].argmax()),)),
    ]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits[:n].double(), dim=-1)
    for i, (r, res) in enumerate(zip(rows, out, strict=True)):
        if r.num_logprobs is None:
            assert res.logprob is None and res.rank is None and res.top_logprobs is None
            continue
        lp = ref[i]
        assert res.logprob == pytest.approx(lp[res.token_id].item(), abs=1e-5)
        order = torch.argsort(lp, descending=True).tolist()
        assert res.rank == order.index(res.token_id) + 1
        if r.num_logprobs == 0:
            assert not res.top_logprobs
            continue
        assert res.top_logprobs is not None
        assert [t for t, _ in res.top_logprobs] == order[: r.num_logprobs]
        assert [v for _, v in res.top_logprobs] == pytest.approx(lp[order[: r.num_logprobs]].tolist(), abs=1e-5)
    assert out[0].rank == 1 and out[0].token_id == int(logits[0].argmax())
    assert out[5].rank == 2  # the raw argmax was banned: the sampled token is second in the raw distribution


def test_batched_inverse_cdf_equals_the_row_by_row_draw() -> None:
    """inverse_cdf_rows (how draw() draws on an accelerator: one pass, one host copy) gives each row what
    inverse_cdf (the CPU path) gives that row alone, including rows with zeros (filtered tokens) and one-hot rows."""
    from dspark.sample.random import inverse_cdf, inverse_cdf_rows

    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(64, 500, generator=g) * 3, dim=-1)
    probs[::3, 100:] = 0.0  # filtered tails
    probs[5] = torch.nn.functional.one_hot(torch.tensor(499), 500).float()  # a greedy row at the last token
    u = [uniform(i, i * 5) for i in range(64)]
    u[7] = 1.0 - 2.0**-53  # the largest uniform: rounding may land on the end of the CDF
    got = inverse_cdf_rows(probs, torch.tensor(u, dtype=torch.float64)).tolist()
    want = [inverse_cdf(probs[i], u[i]) for i in range(64)]
    assert got == want
    assert len(set(got)) > 20  # not vacuous: the rows drew many different tokens
    assert all(probs[i, t] > 0 for i, t in enumerate(got))


def test_vectorised_uniforms_have_the_scalar_bits() -> None:
    """uniforms() is uniform() over arrays, bit for bit, on every stream: extreme and negative seeds, counters past
    2**32, and the draft stream's [R, k] layout."""
    import random

    from dspark.sample.random import DRAFT_STREAM
    from dspark.speculative.drafters.dspark.markov import DraftRow, draft_uniforms

    rng = random.Random(0)
    # SamplingParams.seed may be any signed 64-bit value: the scalar takes its two's-complement bits
    seeds = [0, 1, 2**63 - 1, 2**62 + 12345, -1, -(2**63)] + [rng.getrandbits(64) - 2**63 for _ in range(200)]
    counters = [0, 2**40 + 7, 1, 255, 3, 2**33] + [rng.randrange(0, 1 << 20) for _ in range(200)]
    for stream in (0, 1, 2, DRAFT_STREAM):
        got = uniforms(seeds, counters, stream).tolist()
        assert got == [uniform(s, c, stream) for s, c in zip(seeds, counters, strict=True)], stream
    assert uniforms([], []).shape == (0,)
    rows = [DraftRow(s, c, 1.0, False) for s, c in zip(seeds[:8], counters[:8], strict=True)]
    block = draft_uniforms(rows, 7)
    assert block.shape == (8, 7)
    assert block.tolist() == [[uniform(r.seed, r.first_counter + j, DRAFT_STREAM) for j in range(7)] for r in rows]


def test_uniforms_on_tensors_have_the_same_bits() -> None:
    """uniforms_at() on int64 tensors, from a stream's keys (stream_seeds, made once per request), is uniforms() bit
    for bit, on every stream and shape: extreme and negative seeds, counters past 2**32 (on CUDA in
    tests/sample/test_sample_gpu.py)."""
    import random

    from dspark.sample.random import DRAFT_STREAM, stream_seeds, uniforms_at

    rng = random.Random(1)
    seeds = [0, 1, 2**63 - 1, 2**62 + 12345, -1, -(2**63)] + [rng.getrandbits(64) - 2**63 for _ in range(500)]
    counters = [0, 2**40 + 7, 1, 255, 3, 2**33] + [rng.randrange(0, 1 << 40) for _ in range(500)]
    streams = (0, 1, 2, DRAFT_STREAM)
    keys = stream_seeds(seeds, streams)
    assert keys.shape == (len(seeds), 4) and keys.dtype == np.int64
    for j, stream in enumerate(streams):
        got = uniforms_at(torch.from_numpy(keys[:, j]), torch.tensor(counters))
        assert got.dtype == torch.float64, stream
        assert got.numpy().tobytes() == uniforms(seeds, counters, stream).tobytes(), stream
    assert stream_seeds([], streams).shape == (0, 4)
    grid = uniforms_at(torch.from_numpy(keys[:8, 3:4]), torch.tensor(counters[:8])[:, None] + torch.arange(7))
    assert grid.shape == (8, 7)
    assert grid.tolist() == [
        [uniform(s, c + j, DRAFT_STREAM) for j in range(7)] for s, c in zip(seeds[:8], counters[:8], strict=True)
    ]


def test_negative_seeds_sample_and_verify() -> None:
    """A negative seed (allowed by SamplingParams) goes through the batched draws: sampling, a rejected draft's
    residual draw in verification, and the drafter's uniforms."""
    from dspark.sample.rejection import VerifyRow, verify
    from dspark.speculative.drafters.dspark.markov import DraftRow, draft_uniforms

    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(2, 30, generator=g), dim=-1)
    q = torch.softmax(torch.randn(1, 30, generator=g), dim=-1)
    draft = int(torch.argmin(p[0] / q[0]))  # the draft p likes least against q: most likely rejected
    out = verify(p, q, [VerifyRow(-1, 0, [draft])], "probabilistic")
    assert len(out) == 1 and 1 <= len(out[0]) <= 2 and all(0 <= t < 30 for t in out[0])
    assert draft_uniforms([DraftRow(-(2**63), 0, 1.0, False)], 3).shape == (1, 3)
    row = SamplingRow(1.0, 0, 1.0, 0.0, seed=-5, counter=0, prompt_token_ids=[], output_token_ids=[])
    assert 0 <= Sampler().tokens(p[:1], [row]).item() < 30


def _fast_path(r: SamplingRow) -> str:
    """The sampling path one row alone allows: what Request.sampling_path must agree with."""
    if r.banned_token_ids or r.penalised:
        return "general"
    if r.greedy:
        return "greedy"  # a greedy row's filters change nothing
    return "general" if r.min_p > 0 or r.top_k > 0 or r.top_p < 1.0 else "temperature"


def test_a_requests_sampling_path_is_what_its_rows_allow() -> None:
    """Request.sampling_path, decided once, is the path the request's first sampling row allows, and every later row
    (after more outputs or drafts) allows it too: the runner never has to ask again. The usual requests take a fast
    path; one that may have a stop token banned (min_tokens) takes the general path for good."""
    import itertools

    from dspark.config import GREEDY_BELOW, SamplingParams
    from dspark.core.request import Request
    from dspark.worker.model_runner import sampling_row

    seen = set()
    for temp, top_k, top_p, min_p, pen, min_tokens, ignore_eos, stops, eos in itertools.product(
        (0.0, 1e-6, GREEDY_BELOW, 0.8),
        (-1, 0, 5),
        (1.0, 0.9),
        (0.0, 0.1),
        (0.0, 0.5),
        (0, 3),
        (False, True),
        ([], [7]),
        (2, None),
    ):
        params = SamplingParams(
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=1.0 + pen,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=stops,
        )
        req = Request("r", None, [1, 2, 3], params, seed=3, eos_token_id=eos)
        case = (temp, top_k, top_p, min_p, pen, min_tokens, ignore_eos, stops, eos)
        assert req.sampling_path == _fast_path(sampling_row(req)), case
        seen.add(req.sampling_path)
        if req.sampling_path == "general":
            continue
        for num_out, drafts in itertools.product((0, 2, 5), (0, 1, 3)):
            req.all_token_ids[3:] = [9] * num_out
            row = sampling_row(req, [0] * drafts if drafts else None)
            assert _fast_path(row) == req.sampling_path, (case, num_out, drafts)
            assert row.counter == num_out + drafts and row.seed == req.seed
    assert seen == {"greedy", "temperature", "general"}

    def path(**kw: object) -> str:
        return Request("r", None, [1], SamplingParams(**kw), seed=0, eos_token_id=2).sampling_path  # type: ignore[arg-type]

    assert path() == "temperature"  # the default request: top_k=-1, top_p=1, min_p=0
    assert path(temperature=0.0) == "greedy"
    assert path(temperature=0.0, min_tokens=3) == "general"  # its EOS is banned for 3 tokens
    assert path(temperature=0.0, min_tokens=3, ignore_eos=True) == "greedy"  # nothing to ban


def test_fast_paths_give_the_general_paths_tokens() -> None:
    """Sampler.greedy and Sampler.temperature give Sampler.tokens's tokens for the rows they serve (ragged seeds and
    counters, padding rows past the last), and temperature_probs (what verify_plain and the drafter call) is
    logits_to_probs for rows with a temperature alone or greedy ones, bit for bit."""
    from dspark.sample.ops import softmax_temperatures

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(10, 40, generator=g) * 3  # 2 padding rows
    temps = [0.3, 1.0, 1.7, 0.9, 1.0, 2.5, 0.6, 1e-5]
    rows = [
        SamplingRow(t, 0, 1.0, 0.0, seed=-7 + 11 * i, counter=i * 5, prompt_token_ids=[], output_token_ids=[])
        for i, t in enumerate(temps)
    ]
    sampler = Sampler()
    want = sampler.tokens(logits, rows).tolist()
    seeds, counters = [r.seed for r in rows], [r.counter for r in rows]
    assert sampler.temperature(logits, torch.tensor(temps), seeds, counters).tolist() == want
    assert len(set(want)) > 3  # drawn, not the argmax everywhere

    greedy_rows = [row(temperature=0.0, top_k=5 * (i % 2), seed=i) for i in range(8)]
    assert sampler.greedy(logits[:8]).tolist() == sampler.tokens(logits, greedy_rows).tolist()

    mixed = [rows[i] if i % 3 else greedy_rows[i] for i in range(8)]
    greedy = torch.tensor([r.greedy for r in mixed])
    got = temperature_probs(logits[:8], torch.tensor(softmax_temperatures([r.temperature for r in mixed])), greedy)
    assert torch.equal(got, logits_to_probs(logits, mixed))
    assert torch.equal(got[greedy].argmax(-1), logits[:8][greedy].argmax(-1)) and bool((got[greedy].sum(-1) == 1).all())
