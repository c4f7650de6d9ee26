"""Sampling on CUDA (skipped without a GPU; run with `pytest -m gpu`): the batched draw, device-side
verification and the device's uniforms give what the one-row, host-side paths give."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_sampling_draws_what_a_one_row_draw_gives() -> None:
    """On CUDA, sample_probs draws every row in one batched pass; verification draws one row at a time with
    inverse_cdf. Both must give the same token for the same row and uniform (strict verification relies on it)."""
    from dspark.sample.ops import SamplingRow
    from dspark.sample.random import inverse_cdf, uniform
    from dspark.sample.sampler import sample_probs

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(96, 49152, generator=g) * 4, dim=-1).cuda()
    probs[::5, 3000:] = 0.0
    rows = [SamplingRow(1.0 if i % 9 else 0.0, -1, 1.0, 0.0, i, 3 * i, [], []) for i in range(96)]
    for i, r in enumerate(rows):
        if r.greedy:
            probs[i] = torch.nn.functional.one_hot(probs[i].argmax(), 49152).float()
    got = sample_probs(probs, rows).tolist()
    want = [
        int(probs[i].argmax()) if r.greedy else inverse_cdf(probs[i], uniform(r.seed, r.counter))
        for i, r in enumerate(rows)
    ]
    assert got == want


def test_cuda_verify_plain_gives_verifys_tokens() -> None:
    """verify_plain decides every request on the device, drawing each request's residual and bonus rows in batches
    of another composition than verify() draws them: at SmolLM2's vocabulary the tokens must be the same (a per-row
    scan whatever the batch). 256 mixed requests; one sampled request alone with 0-7 drafts (a one-row draw, which
    CUDA scans with another kernel unless padded); one sampled request among greedy ones."""
    import random

    from dspark.sample.ops import SamplingRow, logits_to_probs
    from dspark.sample.rejection import VerifyRow, verify, verify_plain

    rng, gen = random.Random(0), torch.Generator().manual_seed(0)

    def check(lens: list[int], temps: list[float], method: str) -> int:
        logits = (torch.randn(sum(lens) + len(lens), 49152, generator=gen) * 6).cuda()
        q = torch.softmax(logits[: sum(lens)] + torch.randn(sum(lens), 49152, generator=gen).cuda(), dim=-1)
        tops = logits.argmax(-1).tolist()
        rows, samp, t_row = [], [], 0
        for n, t in zip(lens, temps, strict=True):
            seed, first = rng.randint(-(2**63), 2**63 - 1), rng.randint(0, 300)
            drafts = [tops[t_row + j] if rng.random() < 0.6 else rng.randrange(49152) for j in range(n)]
            rows.append(VerifyRow(seed, first, drafts, t == 0.0))
            samp += [SamplingRow(t, 0, 1.0, 0.0, seed, first + j, [], []) for j in range(n + 1)]
            t_row += n + 1
        draft_probs = q if method == "probabilistic" else None
        want = verify(logits_to_probs(logits, samp), draft_probs, rows, method)
        accepted, last = verify_plain(logits, draft_probs, rows, temps, method)
        got = [[*r.draft_tokens[:a], x] for r, a, x in zip(rows, accepted.tolist(), last.tolist(), strict=True)]
        assert got == want, (lens, temps, method)
        return sum(len(o) - 1 for o in want)

    for method in ("probabilistic", "strict"):
        lens = [rng.randint(0, 7) for _ in range(256)]
        accepted = check(lens, [rng.choice([0.0, 0.7, 1.0]) for _ in lens], method)
        assert accepted > 50  # drafts were accepted, not only corrected
        for n in range(8):
            for _ in range(4):
                check([n], [1.0], method)
                check([3, n, 2], [0.0, 0.8, 0.0], method)


def test_cuda_uniforms_on_the_device_have_the_hosts_bits() -> None:
    """uniforms_at() on CUDA tensors, from stream keys, is uniforms() bit for bit (int64 products wrap there as on the
    CPU)."""
    import random

    from dspark.sample.random import stream_seeds, uniforms, uniforms_at

    rng = random.Random(2)
    seeds = [0, 1, 2**63 - 1, -1, -(2**63)] + [rng.getrandbits(64) - 2**63 for _ in range(4000)]
    counters = [0, 2**40 + 7, 1, 2**33, 5] + [rng.randrange(0, 1 << 40) for _ in range(4000)]
    keys = stream_seeds(seeds, (0, 1, 7))
    for j, stream in enumerate((0, 1, 7)):
        got = uniforms_at(torch.from_numpy(keys[:, j]).cuda(), torch.tensor(counters, device="cuda"))
        assert got.cpu().numpy().tobytes() == uniforms(seeds, counters, stream).tobytes(), stream
