"""The budget allocation's Triton kernel on CUDA (skipped without a GPU; run with `pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_triton_allocate_equals_the_torch_twin() -> None:
    """The Triton kernel picks exactly the torch twin's slots: random survivals with many exact ties, caps, budgets
    from 0 past the number of valid slots; and at R = 1024, K = 7 its time is reported (-s)."""
    import time

    from dspark.speculative.allocate_kernel import allocate_triton
    from dspark.speculative.budget import allocate_torch, slot_caps, survival
    from dspark.utils.platform import triton_available

    assert triton_available()
    g = torch.Generator(device="cuda").manual_seed(0)
    for trial in range(300):
        num_reqs = int(torch.randint(1, 300 if trial % 10 else 1100, (1,)))
        k = int(torch.randint(1, 9, (1,)))
        c = torch.rand(num_reqs, k, device="cuda", generator=g).clamp(min=0.01)
        if trial % 2:
            c = (c * 4).ceil() / 4  # few distinct values: ties everywhere
        a = survival(c)
        a[torch.rand(num_reqs, device="cuda", generator=g) < 0.2, int(torch.randint(0, k, (1,))) :] = 0.0
        caps = slot_caps(a, torch.randint(0, k + 1, (num_reqs,), device="cuda", generator=g))
        budget = int(torch.randint(0, num_reqs * k + 2, (1,)))
        want = allocate_torch(a, budget, caps)
        got = allocate_triton(a, torch.tensor(budget, device="cuda"), caps)
        assert torch.equal(got, want), (trial, num_reqs, k, budget)

    a = survival(torch.rand(1024, 7, device="cuda", generator=g))
    caps = torch.full((1024,), 7, device="cuda")
    budget = torch.tensor(2000, device="cuda")
    for fn in (allocate_triton, allocate_torch):
        fn(a, budget, caps)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(100):
            fn(a, budget, caps)
        torch.cuda.synchronize()
        print(f"\n{fn.__name__} R=1024 K=7: {(time.perf_counter() - start) * 1e4:.1f} us per call")
