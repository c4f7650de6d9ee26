"""Confidence-scheduled verification is lossless in its two lossless modes, and the naive synchronous mode is not
(docs/scheduling.md; the DSpark paper, Appendix A: whether draft k of request r is verified must not depend on the
value of draft k itself).

A tiny bigram "model" drives the real scheduling (speculative/budget.py) and verification (sample/rejection.py): a
target table p(x_t | x_{t-1}), a different drafter table q(x_t | x_{t-1}), and a drafter confidence c(x_{t-1}) in the
draft after a token, so the survival of a request's second draft, c(prompt) * c(x_1), depends on its sampled first
draft. Each trial is one step: K = 2 drafts per request, a policy picks how many of them the target verifies, verify()
emits tokens. The first two tokens of each request (the second drawn from the target as the next step would when the
step emitted only one) must follow the target joint p(x_1 | prompt) p(x_2 | x_1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from dspark.sample.random import inverse_cdf_rows, uniform
from dspark.sample.rejection import VerifyRow, verify
from dspark.speculative.budget import allocate, choose_budget, choose_budget_sync, survival
from dspark.speculative.cost_model import CostModel

V, K = 4, 2
LIVE_STREAM, STALE_STREAM = 7, 8  # the drafter's own randomness: this step's block and an earlier, independent one

# Rows are the previous token. The drafter never proposes token 3, which the target emits; it proposes 1 after 2,
# which the target never emits. Every row has one argmax, so the greedy chain is unambiguous.
TARGET = torch.tensor(
    [
        [0.30, 0.50, 0.20, 0.00],
        [0.10, 0.20, 0.30, 0.40],
        [0.40, 0.00, 0.35, 0.25],
        [0.20, 0.45, 0.25, 0.10],
    ]
)
DRAFTER = torch.tensor(
    [
        [0.2, 0.5, 0.3, 0.0],
        [0.3, 0.3, 0.4, 0.0],
        [0.3, 0.4, 0.3, 0.0],
        [0.6, 0.2, 0.2, 0.0],
    ]
)
CONFIDENCE = torch.tensor([0.9, 0.6, 0.7, 0.4])  # c(x_{t-1}): the drafter's confidence in the draft after x_{t-1}

Policy = Callable[[torch.Tensor, torch.Tensor, CostModel], torch.Tensor]  # live [R, K], stale [R, K] -> counts [R]


@dataclass
class Scenario:
    target: torch.Tensor  # [V, V] p(x_t | x_{t-1})
    drafter: torch.Tensor  # [V, V] q(x_t | x_{t-1})
    confidence: torch.Tensor  # [V]
    prompts: tuple[int, ...]  # each request's last token
    cost: CostModel

    def joint(self, r: int) -> torch.Tensor:
        """[V, V] the target's p(x_1 | prompt_r) p(x_2 | x_1)."""
        return self.target[self.prompts[r]].double()[:, None] * self.target.double()


# Two requests; verifying a token costs 0.3 ms past the first two (flat: the step's last tokens) and drafting a
# little, so Algorithm 1's early stop verifies 1 or 2 drafts a request depending on the live survivals.
BIGRAM = Scenario(
    TARGET, DRAFTER, CONFIDENCE, (0, 2), CostModel.from_points({1: 1.0, 2: 1.0, 8: 2.8}, {1: 0.1, 2: 0.15})
)

# The Appendix A counterexample: one request whose first token is A (0) or B (1) with probability 1/2 under both
# target and drafter; c_1 = 1/2 and c_2 = 1 after A, 0 after B. Graphs captured at 1 and 3 tokens (2 pads to 3):
# 1.0, 1.6 and 1.6 ms for 1, 2 and 3 tokens, no drafting cost. The global argmax over live survivals verifies both
# drafts after A (2 tokens / 1.6 ms beats 1 / 1.0) and none after B (1.5 / 1.6 does not), so P(first = A) = 3/4.
A = 0
COUNTER_TARGET, COUNTER_DRAFTER = TARGET.clone(), DRAFTER.clone()
COUNTER_TARGET[3] = COUNTER_DRAFTER[3] = torch.tensor([0.5, 0.5, 0.0, 0.0])
COUNTEREXAMPLE = Scenario(
    COUNTER_TARGET,
    COUNTER_DRAFTER,
    torch.tensor([1.0, 0.0, 0.0, 0.5]),
    (3,),
    CostModel.from_points({1: 1.0, 3: 1.6}, {1: 0.0}, capture_limit=3),
)


def _async(live: torch.Tensor, stale: torch.Tensor, cost: CostModel) -> torch.Tensor:
    """B* from an earlier block's survivals, the top-B* slots of the live ones."""
    num_reqs = live.shape[0]
    return allocate(live, choose_budget(stale, num_reqs, num_reqs, cost))


def _sync(live: torch.Tensor, stale: torch.Tensor, cost: CostModel) -> torch.Tensor:
    """Algorithm 1 with its early stop, on the live survivals."""
    return choose_budget_sync(live, live.shape[0], live.shape[0], cost)


def _global(live: torch.Tensor, stale: torch.Tensor, cost: CostModel) -> torch.Tensor:
    """The naive synchronous mode: the global argmax budget over the live survivals."""
    num_reqs = live.shape[0]
    return allocate(live, choose_budget(live, num_reqs, num_reqs, cost))


POLICIES: dict[str, Policy] = {"async": _async, "sync": _sync, "global": _global}


@dataclass
class Run:
    emitted: list[list[int]]  # [N * R] what verify() emitted, trial-major
    pairs: torch.Tensor  # [N, R, 2] each request's first two tokens, the second completed by the next step's sampling
    counts: torch.Tensor  # [N, R] drafts verified
    first_drafts: torch.Tensor  # [N, R] the live first draft


def _draft(s: Scenario, prompts: torch.Tensor, seeds: list[int], stream: int) -> torch.Tensor:
    """[n, K] drafts sampled from the drafter's bigram, draft k from uniform(seed, k, stream)."""
    prev, out = prompts, []
    for k in range(K):
        u = torch.tensor([uniform(seed, k, stream) for seed in seeds], dtype=torch.float64)
        prev = inverse_cdf_rows(s.drafter[prev], u)
        out.append(prev)
    return torch.stack(out, dim=1)


def _survivals(s: Scenario, prompts: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """[n, K] a_k = prod_{i<=k} c(token before draft i)."""
    return survival(s.confidence[torch.cat([prompts[:, None], drafts[:, :-1]], dim=1)])


def _simulate(s: Scenario, policy: Policy, num_trials: int, greedy: bool = False, chunk: int = 2500) -> Run:
    num_reqs = len(s.prompts)
    completion = torch.Generator().manual_seed(1234)  # the next step's sampling, independent of everything above
    # A policy is a pure function of the survivals, which take few distinct values here: memoised for speed.
    decided: dict[tuple[float, ...], list[int]] = {}
    emitted, pairs, counts, firsts = [], [], [], []
    for start in range(0, num_trials, chunk):
        n = min(chunk, num_trials - start)
        seeds = list(range(start * num_reqs, (start + n) * num_reqs))  # one per request and trial
        prompts = torch.tensor(s.prompts).repeat(n)
        live = _draft(s, prompts, seeds, LIVE_STREAM)
        a_live = _survivals(s, prompts, live).view(n, num_reqs, K)
        a_stale = _survivals(s, prompts, _draft(s, prompts, seeds, STALE_STREAM)).view(n, num_reqs, K)
        rows, t_index, d_index = [], [], []
        for t in range(n):
            key = tuple(a_live[t].flatten().tolist() + a_stale[t].flatten().tolist())
            if key not in decided:
                decided[key] = policy(a_live[t], a_stale[t], s.cost).tolist()
            for r, ell in enumerate(decided[key]):
                i = t * num_reqs + r
                drafts = live[i, :ell].tolist()
                prev = [s.prompts[r], *drafts]  # the token before each verified draft, then before the bonus
                t_index += prev
                d_index += prev[:ell]
                rows.append(VerifyRow(seeds[i], 0, drafts, greedy))
            counts.append(decided[key])
        out = verify(s.target[t_index], s.drafter[d_index], rows)
        first = torch.tensor([e[0] for e in out])
        second = torch.tensor([e[1] if len(e) > 1 else -1 for e in out])
        short = second < 0
        if short.any():
            second[short] = torch.multinomial(s.target[first[short]], 1, generator=completion).squeeze(1)
        emitted += out
        pairs.append(torch.stack([first, second], dim=1).view(n, num_reqs, 2))
        firsts.append(live[:, 0].view(n, num_reqs))
    return Run(emitted, torch.cat(pairs), torch.tensor(counts), torch.cat(firsts))


def _chi_square(pairs: torch.Tensor, joint: torch.Tensor) -> tuple[float, torch.Tensor]:
    """p-value of the observed (x_1, x_2) pairs [N, 2] against the joint [V, V]; also the observed counts [V, V]."""
    observed = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double().view(V, V)
    expected = joint * pairs.shape[0]
    support = expected > 0
    assert observed[~support].sum() == 0, f"a pair with target probability 0 was emitted: {observed.tolist()}"
    chi2 = (((observed - expected) ** 2)[support] / expected[support]).sum()
    df = torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, chi2 / 2)), observed


LOSSLESS = {
    "async": (BIGRAM, "async"),
    "sync early stop": (BIGRAM, "sync"),
    "async on the counterexample": (COUNTEREXAMPLE, "async"),
}


@pytest.mark.parametrize("case", list(LOSSLESS))
def test_lossless_modes_emit_the_target_joint(case: str) -> None:
    s, policy = LOSSLESS[case]
    run = _simulate(s, POLICIES[policy], 20000)
    for r in range(len(s.prompts)):
        p_value, observed = _chi_square(run.pairs[:, r], s.joint(r))
        assert p_value > 1e-3, f"{case}, request {r}: (x_1, x_2) {observed.tolist()} (p = {p_value:.2e})"

    # Not vacuous: how many drafts a request verifies varies, and with the value of its live first draft.
    frequent, spread = [], 0.0
    for r in range(len(s.prompts)):
        frequent.append([c for c in range(K + 1) if (run.counts[:, r] == c).double().mean() > 0.05])
        means = [run.counts[run.first_drafts[:, r] == x, r].double().mean() for x in run.first_drafts[:, r].unique()]
        spread = max(spread, float(max(means) - min(means)))
    assert max(len(f) for f in frequent) >= 2, f"{case}: each request verifies a fixed number of drafts {frequent}"
    assert spread > 0.2, f"{case}: the verified counts do not depend on the live drafts (spread {spread:.2f})"


def test_global_argmax_over_live_survivals_is_biased() -> None:
    s = COUNTEREXAMPLE
    assert s.cost.step_ms(1, torch.tensor([1, 2, 3])).tolist() == [1.0, 1.6, 1.6]  # 2 tokens pad to the 3-token graph
    run = _simulate(s, _global, 4000)
    after_a = run.first_drafts[:, 0] == A
    assert (run.counts[after_a, 0] == 2).all() and (run.counts[~after_a, 0] == 0).all()
    p_value, observed = _chi_square(run.pairs[:, 0], s.joint(0))
    first = (observed.sum(dim=1) / observed.sum()).tolist()  # the marginal of the first token
    assert p_value < 1e-6, f"no bias detected: first token {first} (target 0.5 each for A, B; p = {p_value:.2e})"
    assert abs(first[A] - 0.75) < 0.03, f"first token {first}: the counterexample predicts P(A) = 0.75"


@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_emits_the_target_argmax_chain(policy: str) -> None:
    s = BIGRAM
    tops = s.target.argmax(dim=-1).tolist()
    chains = []
    for prompt in s.prompts:
        chain = [tops[prompt]]
        for _ in range(K):
            chain.append(tops[chain[-1]])
        chains.append(chain)
    run = _simulate(s, POLICIES[policy], 400, greedy=True)
    lengths = set()
    for i, out in enumerate(run.emitted):
        r = i % len(s.prompts)
        assert 1 <= len(out) <= int(run.counts.view(-1)[i]) + 1
        assert out == chains[r][: len(out)], f"request {r}: emitted {out}, the argmax chain is {chains[r]}"
        lengths.add(len(out))
    assert lengths == {1, 2, 3}  # corrections at both drafts and the bonus all happen
