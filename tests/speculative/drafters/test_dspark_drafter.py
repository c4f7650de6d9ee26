"""The DSpark drafter (docs/drafter.md), on random weights, CPU fp32:

- its paged, batched forward (DSparkDrafter.extend_context + propose) equals a dense reference written here from the
  paper's equations: context features fc -> hidden_norm of the tapped target layers, used as extra keys/values of
  every draft layer; a block [anchor, mask x (K-1)] attending bidirectionally within itself; Qwen3-style layers;
  logits_k = lm_head(h_k) + W2 W1[x_{k-1}] sampled left to right; c_k = sigmoid(proj([h_k; W1[x_{k-1}]]) / T_k);
- a request's drafts, draft distributions and confidences do not depend on its batch (bitwise);
- checkpoints: save/load round trips, DeepSpec / DFlash config layouts, and a clear ModelLoadError for every bad file;
- a random drafter fits any supported target; tapped layers are spread over 1..L-3;
- the engine checks num_speculative_tokens, a missing drafter and a drafter made for another target.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspark import LLM, ConfigError, ModelLoadError, SamplingParams
from dspark.attention.base import AttentionContext, AttentionMetadata, KVCache, slots_for
from dspark.attention.torch_ref import TorchAttention
from dspark.core.request import Request
from dspark.models.llama import CausalLM, use_fast_cpu_path
from dspark.models.loader import load_config, load_model
from dspark.sample.random import inverse_cdf, uniform
from dspark.speculative.drafters.base import Proposal
from dspark.speculative.drafters.dspark.checkpoint import load_drafter, random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig, default_target_layer_ids
from dspark.speculative.drafters.dspark.drafter import DSparkDrafter
from dspark.speculative.drafters.dspark.markov import DRAFT_STREAM
from dspark.speculative.drafters.dspark.model import DSparkModel
from helpers import FAMILIES, make_hf_model

CPU = torch.device("cpu")
F32 = torch.float32
V = 49152  # the tiny models' vocabulary (SmolLM2's)
TARGET_LAYERS = 6  # our own targets: deep enough for two distinct taps, (1, 3)
K = 5  # the drafter's block size
PAGE = 4  # the drafter cache's block size: a request spans many, non-contiguous blocks
NUM_BLOCKS = 96
# Tokens per request, anchor included: contexts of 1..130 positions (up to three attention tiles of 64), and five
# requests, so the drafter pads its rows.
LENGTHS = (2, 70, 18, 131, 9)
TEMPERATURES = (0.7, 1.0, 0.0, 1.3, 0.5)  # request 2 is greedy inside a probabilistic batch
MASK_ID = 49151
VARIANTS = ("learned_mask", "mask_token", "no_confidence")


def _sts(block_size: int) -> tuple[float, ...]:
    """Per-position confidence calibration temperatures."""
    return tuple((0.5, 1.0, 2.0, 1.5, 0.8)[i % 5] for i in range(block_size))


def _sts_biases(block_size: int) -> tuple[float, ...]:
    """Per-position confidence calibration shifts."""
    return tuple((-0.7, 0.0, 1.2, -2.0)[i % 4] for i in range(block_size))


@dataclass
class Context:
    tokens: list[list[int]]  # per request, anchor last
    taps: list[torch.Tensor]  # per request: the target's tapped layers over all tokens but the anchor


# ---- set-up -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> a saved 6-layer tiny target (no tokenizer: only load_model reads it)."""
    dirs = {}
    for family in FAMILIES:
        out = tmp_path_factory.mktemp(f"target6-{family}")
        make_hf_model(family, seed=3, num_hidden_layers=TARGET_LAYERS).save_pretrained(out, safe_serialization=True)
        dirs[family] = out
    return dirs


@pytest.fixture(scope="module")
def targets(target_dirs: dict[str, Path]) -> dict[str, CausalLM]:
    return {f: load_model(p, F32, CPU) for f, p in target_dirs.items()}


@pytest.fixture(scope="module")
def contexts(targets: dict[str, CausalLM]) -> dict[str, Context]:
    """family -> random requests and their target taps at layers (1, 3)."""
    out = {}
    for family, target in targets.items():
        g = torch.Generator().manual_seed(7)
        tokens = [torch.randint(3, V, (n,), generator=g).tolist() for n in LENGTHS]
        out[family] = Context(tokens, [_target_taps(target, t[:-1], (1, 3)) for t in tokens])
    return out


def _target_taps(target: CausalLM, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """Prefill `tokens` through the target with its own attention and a scratch paged cache; the tapped outputs."""
    cfg, n, bs = target.config, len(tokens), 16
    nb = -(-n // bs)
    caches = [
        KVCache(
            torch.zeros(nb, bs, cfg.num_kv_heads, cfg.head_dim), torch.zeros(nb, bs, cfg.num_kv_heads, cfg.head_dim)
        )
        for _ in range(cfg.num_layers)
    ]
    meta = AttentionMetadata(
        num_actual_tokens=n,
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(nb, dtype=torch.int32)[None],
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
        max_query_len=n,
        max_seq_len=n,
    )
    backend = TorchAttention()
    backend.prepare(meta, cfg.num_kv_heads, cfg.num_heads, bs)
    with torch.inference_mode():
        _, taps = target.forward_with_taps(
            torch.tensor(tokens), torch.arange(n), AttentionContext(backend, meta, caches), layers
        )
    assert taps is not None and taps.shape == (n, len(layers) * cfg.hidden_size)
    return taps.clone()


def test_on_taps_gets_the_taps_as_soon_as_the_last_tapped_layer_ran(targets: dict[str, CausalLM]) -> None:
    """A CUDA graph forks the drafter's context write off where the last tapped layer is done, so that it overlaps
    the layers after it (worker/cuda_graphs.py). The hook gets the taps there, once, before any later layer runs."""
    target = next(iter(targets.values()))
    tokens = list(range(5, 16))
    want = _target_taps(target, tokens, (1, 3))
    layers_run: list[int] = []
    handles = [layer.register_forward_hook(lambda *_: layers_run.append(1)) for layer in target.model.layers]
    got: list[tuple[int, torch.Tensor]] = []

    def on_taps(taps: list[torch.Tensor]) -> None:
        got.append((len(layers_run), torch.cat(taps, dim=-1).clone()))

    n = len(tokens)
    meta = AttentionMetadata(
        num_actual_tokens=n,
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
        max_query_len=n,
        max_seq_len=n,
    )
    cfg = target.config
    caches = [
        KVCache(torch.zeros(1, 16, cfg.num_kv_heads, cfg.head_dim), torch.zeros(1, 16, cfg.num_kv_heads, cfg.head_dim))
        for _ in range(cfg.num_layers)
    ]
    backend = TorchAttention()
    backend.prepare(meta, cfg.num_kv_heads, cfg.num_heads, 16)
    try:
        with torch.inference_mode():
            _, returned = target.forward_with_taps(
                torch.tensor(tokens), torch.arange(n), AttentionContext(backend, meta, caches), (1, 3), on_taps
            )
    finally:
        for h in handles:
            h.remove()
    assert returned is None  # they went to the hook instead
    assert len(layers_run) == TARGET_LAYERS
    assert len(got) == 1 and got[0][0] == 4  # layers 0..3 had run, 4 and 5 had not
    torch.testing.assert_close(got[0][1], want, rtol=0, atol=0)


class _StubNorm:
    """Records its calls; forward_add returns (norm, residual) as the fused RMSNorm does, as new tensors."""

    cpu_fused = False  # RMSNorm's: the fused structure on CPU comes from fused_ops.forced here

    def __init__(self, name: object, log: list[tuple[str, object]]) -> None:
        self.name, self.log = name, log

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(("norm", self.name))
        return x * 1.0

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.log.append(("add", self.name))
        total = x + residual
        return total * 1.0, total


class _StubLayer:
    def __init__(self, i: int, log: list[tuple[str, object]]) -> None:
        self.i, self.log, self.input_layernorm = i, log, _StubNorm(i, log)

    def __call__(self, x: torch.Tensor, rope: object, ctx: object) -> torch.Tensor:
        self.log.append(("layer", self.i))
        return x + self.i + 1

    def forward_fused(
        self, h: torch.Tensor, residual: torch.Tensor, rope: object, ctx: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.log.append(("layer", self.i))
        return torch.full_like(h, self.i + 1.0), residual


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("taps", [(1, 3), (5,), (0, 5), (0,)])
def test_on_taps_fires_once_right_after_the_last_tap_on_both_paths(fused: bool, taps: tuple[int, ...]) -> None:
    """On the fused path (CUDA) a layer's output first exists inside the next layer's add+norm, and the last layer's
    inside the final norm: the hook fires there, once, with the same taps the stack returns, before any later layer."""
    from dspark.models import fused_ops
    from dspark.models.llama import decoder_stack

    log: list[tuple[str, object]] = []
    layers = [_StubLayer(i, log) for i in range(6)]
    seen: list[list[torch.Tensor]] = []

    def hook(got: list[torch.Tensor]) -> None:
        log.append(("hook", len(got)))
        seen.append(list(got))

    with fused_ops.forced(fused):
        _, returned = decoder_stack(layers, _StubNorm("final", log), torch.zeros(2, 3), None, None, taps, hook)
    assert [e for e in log if e[0] == "hook"] == [("hook", len(taps))]
    after = log[log.index(("hook", len(taps))) + 1 :]
    assert not [e for e in after if e[0] == "layer" and e[1] <= max(taps)]  # the tapped layers had all run
    assert [e for e in after if e[0] == "layer"] == [("layer", i) for i in range(max(taps) + 1, 6)]  # later ones not
    assert len(seen[0]) == len(returned) and all(a is b for a, b in zip(seen[0], returned, strict=True))


def _drafter_config(target: CausalLM, variant: str = "learned_mask", block_size: int = K) -> DSparkConfig:
    cfg = DSparkConfig.for_target(
        target.config,
        num_layers=2,
        block_size=block_size,
        num_taps=2,
        markov_rank=8,
        confidence_head=variant != "no_confidence",
    )
    if variant == "mask_token":
        cfg = dataclasses.replace(
            cfg, mask_token_id=MASK_ID, sts_temperatures=_sts(block_size), sts_biases=_sts_biases(block_size)
        )
    return cfg


def _drafter_model(target: CausalLM, variant: str = "learned_mask", seed: int = 0, block_size: int = K) -> DSparkModel:
    """A random drafter whose every weight matters: norms away from 1 and a Markov correction as large as the
    backbone's logits (random_drafter starts it near zero)."""
    model = random_drafter(_drafter_config(target, variant, block_size), seed)
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "markov" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name == "mask_embedding":
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def _drafter(
    model: DSparkModel,
    target: CausalLM,
    ctx: Context,
    sample: bool,
    k: int | None = None,
    seed: int = 0,
    defer_rows: int | None = None,
) -> tuple[DSparkDrafter, list[Request]]:
    """A drafter whose paged cache holds every request's context (written in two chunks, as chunked prefill would),
    and the requests, each on blocks scattered over the cache. defer_rows: defer the context write (the fast CPU
    path) with this many rows held at most."""
    block = model.config.block_size
    drafter = DSparkDrafter(model, target, k or block, sample, NUM_BLOCKS, PAGE, CPU, F32)
    if defer_rows is not None:
        drafter.defer_context, drafter.DEFER_ROWS = True, defer_rows
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    requests, chunks = [], [([], [], []), ([], [], [])]
    for i, (tokens, taps) in enumerate(zip(ctx.tokens, ctx.taps, strict=True)):
        n = len(tokens)
        need = -(-(n - 1 + block) // PAGE)
        blocks, perm = perm[:need], perm[need:]
        req = Request(
            request_id=f"r{i}",
            prompt=None,
            prompt_token_ids=tokens[: max(1, n - 3)],  # the rest are outputs: drafting counters start past 0
            sampling_params=SamplingParams(temperature=TEMPERATURES[i]),
            seed=1234 + i,
            eos_token_id=None,
        )
        req.all_token_ids = list(tokens)
        req.num_computed_tokens = n - 1
        req.block_ids = blocks
        requests.append(req)
        half = (n - 1) // 2
        for (t, p, s), lo, hi in ((chunks[0], 0, half), (chunks[1], half, n - 1)):
            t.append(taps[lo:hi])
            p += range(lo, hi)
            s += slots_for(blocks, lo, hi, PAGE)
    for t, p, s in chunks:
        drafter.extend_context(torch.cat(t), torch.tensor(p, dtype=torch.int64), torch.tensor(s, dtype=torch.int64))
    return drafter, requests


# ---- the dense reference ----------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w.double() * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE, x: [n, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None, None] * inv
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], dim=-1)


def _w(m: torch.nn.Module) -> torch.Tensor:
    return m.weight.detach().double()


@dataclass
class Reference:
    logits: torch.Tensor  # [k, V] fp64: the draft logits given the previous (drafted) tokens
    confidence: torch.Tensor | None  # [k] fp64, calibrated


class Dense:
    """The drafter, densely and in fp64, from the equations (weights read once)."""

    def __init__(self, model: DSparkModel, target: CausalLM) -> None:
        self.model, self.cfg = model, model.config
        self.embed = target.model.embed_tokens.weight.detach()
        self.lm_head = _w(target.lm_head)  # [V, H]
        self.w1, self.w2 = _w(model.markov_head.markov_w1), _w(model.markov_head.markov_w2)  # [V, r] each

    def block(self, tokens: list[int], taps: torch.Tensor) -> torch.Tensor:
        """[K, H]: the final (normed) states of the block anchored at tokens[-1], after context tokens[:-1]."""
        model, cfg = self.model, self.cfg
        eps, theta, hd, nh, nkv = cfg.rms_norm_eps, cfg.rope_theta, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        a = len(tokens) - 1  # the anchor's position; the context is positions 0..a-1
        ctx_pos, blk_pos = torch.arange(a), torch.arange(a, a + cfg.block_size)
        feats = _rms(taps.double() @ _w(model.fc).T, _w(model.hidden_norm), eps)  # [a, H]
        if cfg.mask_token_id is not None:
            mask = self.embed[cfg.mask_token_id].double()
        else:
            mask = model.mask_embedding.detach().double()
        x = torch.stack([self.embed[tokens[-1]].double()] + [mask] * (cfg.block_size - 1))  # [K, H]
        for layer in model.layers:
            at = layer.self_attn
            h = _rms(x, _w(layer.input_layernorm), eps)
            q = _rope(_rms((h @ _w(at.q_proj).T).view(-1, nh, hd), _w(at.q_norm), eps), blk_pos, theta)

            def kv(src: torch.Tensor, pos: torch.Tensor, at: Any = at) -> tuple[torch.Tensor, torch.Tensor]:
                k = _rope(_rms((src @ _w(at.k_proj).T).view(-1, nkv, hd), _w(at.k_norm), eps), pos, theta)
                return k, (src @ _w(at.v_proj).T).view(-1, nkv, hd)

            (kc, vc), (kb, vb) = kv(feats, ctx_pos), kv(h, blk_pos)
            keys = torch.cat([kc, kb]).repeat_interleave(nh // nkv, dim=1)  # [a + K, nh, hd]: no mask at all
            values = torch.cat([vc, vb]).repeat_interleave(nh // nkv, dim=1)
            p = torch.softmax(torch.einsum("qhd,khd->hqk", q, keys) / hd**0.5, dim=-1)
            x = x + torch.einsum("hqk,khd->qhd", p, values).reshape(cfg.block_size, nh * hd) @ _w(at.o_proj).T
            h = _rms(x, _w(layer.post_attention_layernorm), eps)
            gate = h @ _w(layer.mlp.gate_proj).T
            x = x + (gate * torch.sigmoid(gate) * (h @ _w(layer.mlp.up_proj).T)) @ _w(layer.mlp.down_proj).T
        return _rms(x, _w(model.norm), eps)

    def __call__(self, tokens: list[int], taps: torch.Tensor, drafted: list[int]) -> Reference:
        """`drafted`: the previous-token inputs of the Markov and confidence heads after the anchor."""
        hk = self.block(tokens, taps)
        prev = [tokens[-1], *drafted]
        k = len(drafted)
        logits = hk[:k] @ self.lm_head.T + self.w1[prev[:k]] @ self.w2.T  # lm_head(h_k) + W2 W1[x_{k-1}]
        conf = None
        head = self.model.confidence_head
        if head is not None:
            temps = torch.tensor(self.cfg.sts_temperatures or (1.0,) * self.cfg.block_size, dtype=torch.float64)
            z = torch.cat([hk[:k], self.w1[prev[:k]]], dim=-1) @ _w(head.proj)[0] + head.proj.bias.double()[0]
            biases = torch.tensor(self.cfg.sts_biases or (0.0,) * self.cfg.block_size, dtype=torch.float64)
            conf = torch.sigmoid(z / temps[:k] + biases[:k])
        return Reference(logits, conf)


def _check_against_reference(
    model: DSparkModel, target: CausalLM, ctx: Context, proposal: Proposal, sample: bool, k: int
) -> None:
    dense = Dense(model, target)
    for r, (tokens, taps) in enumerate(zip(ctx.tokens, ctx.taps, strict=True)):
        drafted = proposal.token_ids[r]
        assert len(drafted) == k and all(0 <= t < V for t in drafted)
        ref = dense(tokens, taps, drafted)
        temperature = TEMPERATURES[r]
        greedy = not sample or temperature == 0.0
        if greedy:
            top2 = torch.topk(ref.logits, 2, dim=-1).values  # [k, 2]
            for j, tok in enumerate(drafted):
                # The argmax; these random weights give no near-ties, where fp32 rounding could pick another.
                assert top2[j, 0] - top2[j, 1] > 1e-4
                assert tok == int(ref.logits[j].argmax()), (r, j)
        if sample:
            assert proposal.probs is not None and proposal.probs.shape == (len(ctx.tokens), k, V)
            probs = proposal.probs[r].double()
            if greedy:
                expected = torch.nn.functional.one_hot(torch.tensor(drafted), V).double()
            else:
                expected = torch.softmax(ref.logits / temperature, dim=-1)
            torch.testing.assert_close(probs, expected, rtol=2e-5, atol=1e-9, msg=lambda m, r=r: f"request {r}: {m}")
            counter = len(tokens) - max(1, len(tokens) - 3)  # the request's output tokens so far
            for j, tok in enumerate(drafted):
                assert probs[j, tok] > 0
                # Drawn by inverse CDF with the request's counter-based draft stream: reproducible per request.
                assert tok == inverse_cdf(proposal.probs[r, j], uniform(1234 + r, counter + j, DRAFT_STREAM)), (r, j)
        else:
            assert proposal.probs is None
        if ref.confidence is None:
            assert proposal.confidences is None
        else:
            assert proposal.confidences is not None
            got = proposal.confidences[r].double()
            torch.testing.assert_close(got, ref.confidence, rtol=0, atol=1e-5, msg=lambda m, r=r: f"request {r}: {m}")


# ---- 1. forward vs the reference ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "variant"),
    [
        ("llama", "learned_mask"),
        ("qwen2", "learned_mask"),
        ("qwen3", "learned_mask"),
        ("llama", "mask_token"),
        ("qwen3", "mask_token"),
        ("llama", "no_confidence"),
    ],
)
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "probabilistic"])
def test_forward_matches_the_dense_reference(
    targets: dict[str, CausalLM], contexts: dict[str, Context], family: str, variant: str, sample: bool
) -> None:
    target, ctx = targets[family], contexts[family]
    model = _drafter_model(target, variant, seed=VARIANTS.index(variant))
    assert model.config.target_layer_ids == (1, 3)
    assert (model.config.mask_token_id is None) == hasattr(model, "mask_embedding")
    k = K - 2 if variant == "mask_token" else K  # fewer drafts than the block: the first k slots
    drafter, requests = _drafter(model, target, ctx, sample, k=k)
    proposal = drafter.propose(requests)
    _check_against_reference(model, target, ctx, proposal, sample, k)


@pytest.mark.parametrize(("family", "variant"), [("llama", "learned_mask"), ("qwen3", "mask_token")])
def test_training_forward_matches_the_dense_reference(
    targets: dict[str, CausalLM], contexts: dict[str, Context], family: str, variant: str
) -> None:
    """The training pass (train/forward.py) packs several blocks of one sequence with a mask; each block's states,
    teacher-forced draft logits and confidences equal the dense reference's for a block at that anchor."""
    from dspark.train.forward import block_states, draft_outputs

    target, ctx = targets[family], contexts[family]
    model = _drafter_model(target, variant, seed=4)
    tokens, taps = torch.tensor(ctx.tokens[3]), ctx.taps[3]  # 131 tokens; taps of all but the last
    anchors = torch.tensor([1, 7, 64, 120])
    dense = Dense(model, target)
    with torch.no_grad():
        features = model.context_features(taps)[None]
        states = block_states(model, target.model.embed_tokens, tokens[None], features, anchors[None])[0]
        previous = torch.stack([tokens[a : a + K] for a in anchors.tolist()])  # the anchor, then the target's tokens
        logits, conf = draft_outputs(model, target, states, previous)
    for b, a in enumerate(anchors.tolist()):
        ref_states = dense.block(tokens[: a + 1].tolist(), taps[:a])
        torch.testing.assert_close(states[b].double(), ref_states, rtol=1e-4, atol=1e-4, msg=lambda m, a=a: f"{a}: {m}")
        ref = dense(tokens[: a + 1].tolist(), taps[:a], [*tokens[a + 1 : a + K].tolist(), 0])
        torch.testing.assert_close(logits[b].double(), ref.logits, rtol=1e-4, atol=2e-4, msg=lambda m, a=a: f"{a}: {m}")
        if ref.confidence is not None:
            assert conf is not None
            temps = torch.tensor(model.config.sts_temperatures or (1.0,) * K, dtype=torch.float64)
            biases = torch.tensor(model.config.sts_biases or (0.0,) * K, dtype=torch.float64)
            torch.testing.assert_close(
                torch.sigmoid(conf[b].double() / temps + biases), ref.confidence, rtol=0, atol=1e-5
            )


def test_reference_is_sensitive_to_the_markov_head(targets: dict[str, CausalLM], contexts: dict[str, Context]) -> None:
    """The comparison has teeth: the Markov correction and the previous token move the logits far past tolerance."""
    target, ctx = targets["llama"], contexts["llama"]
    dense = Dense(_drafter_model(target), target)
    tokens, taps = ctx.tokens[1], ctx.taps[1]
    with_prev = dense(tokens, taps, [5, 6]).logits
    other_prev = dense(tokens, taps, [7, 6]).logits
    assert torch.equal(with_prev[0], other_prev[0])  # position 0 follows the anchor either way
    assert (with_prev[1] - other_prev[1]).abs().max() > 0.1
    shorter = dense(tokens[:-1], taps[:-1], [5]).logits  # another anchor and context
    assert (with_prev[0] - shorter[0]).abs().max() > 0.1


# ---- 2. batch invariance -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [K, 10], ids=["batched-attention", "per-request-attention"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "probabilistic"])
def test_drafts_do_not_depend_on_the_batch(
    targets: dict[str, CausalLM], contexts: dict[str, Context], block_size: int, sample: bool
) -> None:
    target, ctx = targets["llama"], contexts["llama"]
    model = _drafter_model(target, "mask_token", block_size=block_size)
    drafter, requests = _drafter(model, target, ctx, sample)
    alone = [drafter.propose([r]) for r in requests]
    batches = [list(range(len(requests))), [3, 0], [4, 2, 1]]
    for order in batches:
        together = drafter.propose([requests[i] for i in order])
        for row, i in enumerate(order):
            assert together.token_ids[row] == alone[i].token_ids[0], (order, i)
            if sample:
                assert together.probs is not None
                if alone[i].probs is None:  # a greedy request alone: an argmax-only pass, no distribution
                    assert requests[i].sampling_params.temperature == 0.0
                    one_hot = torch.nn.functional.one_hot(torch.tensor(alone[i].token_ids[0]), V).float()
                    assert torch.equal(together.probs[row], one_hot), (order, i)  # what a mixed pass carries
                else:
                    assert torch.equal(together.probs[row], alone[i].probs[0]), (order, i)
            assert together.confidences is not None and alone[i].confidences is not None
            assert torch.equal(together.confidences[row], alone[i].confidences[0]), (order, i)
    # Asking again (the block's own keys were written meanwhile) gives the same again.
    again = drafter.propose([requests[1]])
    assert again.token_ids == alone[1].token_ids and torch.equal(again.confidences, alone[1].confidences)


def _cache_is_empty(drafter: DSparkDrafter) -> bool:
    return all(not c.key.any() and not c.value.any() for c in drafter.caches)


def test_deferred_context_rows_are_written_before_anything_reads_them(
    targets: dict[str, CausalLM], contexts: dict[str, Context]
) -> None:
    target, ctx = targets["llama"], contexts["llama"]
    model = _drafter_model(target)
    eager, requests = _drafter(model, target, ctx, sample=True)
    deferred, _ = _drafter(model, target, ctx, sample=True, defer_rows=10_000)
    assert _cache_is_empty(deferred) and deferred._pending_rows == sum(len(t) - 1 for t in ctx.tokens)
    # A slot written twice (a rejected draft's row, then the accepted token's) keeps the later row.
    req = requests[1]
    pos = torch.tensor([req.num_computed_tokens - 1], dtype=torch.int64)
    slot = torch.tensor(slots_for(req.block_ids, int(pos), int(pos) + 1, PAGE), dtype=torch.int64)
    g = torch.Generator().manual_seed(7)
    first, later = (torch.randn(1, ctx.taps[1].shape[1], generator=g) for _ in range(2))
    for drafter in (eager, deferred):
        drafter.extend_context(first, pos, slot)
        drafter.extend_context(later, pos, slot)
    assert _cache_is_empty(deferred)
    a, b = eager.propose(requests), deferred.propose(requests)  # the block reads the context: it is written first
    assert deferred._pending_rows == 0 and not deferred._pending
    assert a.token_ids == b.token_ids
    assert a.probs is not None and b.probs is not None and torch.allclose(a.probs, b.probs, atol=1e-6)
    assert a.confidences is not None and b.confidences is not None
    assert torch.allclose(a.confidences, b.confidences, atol=1e-6)
    for ca, cb in zip(eager.caches, deferred.caches, strict=True):
        assert torch.allclose(ca.key, cb.key, atol=1e-5) and torch.allclose(ca.value, cb.value, atol=1e-5)


@pytest.mark.parametrize("variant", ["learned_mask", "mask_token"])
def test_the_fast_cpu_path_drafts_as_the_reference_path(
    targets: dict[str, CausalLM], contexts: dict[str, Context], variant: str
) -> None:
    """use_fast_cpu_path on the drafter (packed fc and context keys/values, C norms and RoPE, the Markov argmax): the
    same context in the cache and the same drafts, to fp32 rounding of a different summation order."""
    target, ctx = targets["qwen3"], contexts["qwen3"]
    model = _drafter_model(target, variant)
    fast_model = copy.deepcopy(model)
    use_fast_cpu_path(fast_model)
    assert fast_model.context_kv_packed is not None and fast_model.fc_packed is not None
    for sample in (False, True):
        ref, requests = _drafter(model, target, ctx, sample)
        fast, _ = _drafter(fast_model, target, ctx, sample)
        for a, b in zip(ref.caches, fast.caches, strict=True):
            torch.testing.assert_close(a.key, b.key, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.value, b.value, atol=1e-5, rtol=1e-5)
        pa, pb = ref.propose(requests), fast.propose(requests)
        assert pa.token_ids == pb.token_ids
        assert pa.confidences is not None and pb.confidences is not None
        torch.testing.assert_close(pa.confidences, pb.confidences, atol=1e-5, rtol=1e-5)


def test_deferred_context_rows_are_written_once_the_limit_is_held(
    targets: dict[str, CausalLM], contexts: dict[str, Context]
) -> None:
    target = targets["llama"]
    drafter = DSparkDrafter(_drafter_model(target), target, K, False, NUM_BLOCKS, PAGE, CPU, F32)
    drafter.defer_context = True
    width = contexts["llama"].taps[0].shape[1]
    g = torch.Generator().manual_seed(3)
    for i in range(drafter.DEFER_ROWS - 1):
        drafter.extend_context(torch.randn(1, width, generator=g), torch.tensor([i]), torch.tensor([i]))
    assert _cache_is_empty(drafter) and drafter._pending_rows == drafter.DEFER_ROWS - 1
    drafter.extend_context(torch.randn(2, width, generator=g), torch.tensor([70, 71]), torch.tensor([70, 71]))
    assert drafter._pending_rows == 0 and not _cache_is_empty(drafter)
    written = [int(s) for s in drafter.caches[0].key.flatten(0, 1).abs().sum((1, 2)).nonzero()]
    assert written == [*range(drafter.DEFER_ROWS - 1), 70, 71]


# ---- 3. checkpoints ----------------------------------------------------------------------------------------------


def _same_proposals(a: DSparkModel, b: DSparkModel, target: CausalLM, ctx: Context) -> None:
    for sample in (False, True):
        da, ra = _drafter(a, target, ctx, sample)
        db, rb = _drafter(b, target, ctx, sample)
        pa, pb = da.propose(ra), db.propose(rb)
        assert pa.token_ids == pb.token_ids
        assert (pa.confidences is None and pb.confidences is None) or torch.equal(pa.confidences, pb.confidences)  # type: ignore[arg-type]
        assert (pa.probs is None and pb.probs is None) or torch.equal(pa.probs, pb.probs)  # type: ignore[arg-type]


def test_each_request_takes_the_calibration_fitted_at_its_temperature(
    targets: dict[str, CausalLM], contexts: dict[str, Context]
) -> None:
    """A drafter with fits at T = 0 and T = 1: in one batch (requests at 0.7, 1.0, greedy, 1.3 and 0.5) every
    request's confidences are its raw head logits scaled as StsTable.at says for its temperature (the greedy one
    with the T = 0 fit, 1.3 with the T = 1 fit), and the drafts themselves do not change."""
    import numpy as np

    from dspark.speculative.calibration import StsEntry

    target, ctx = targets["llama"], contexts["llama"]
    raw = _drafter_model(target, seed=8)
    table = (StsEntry(0.0, _sts(K), _sts_biases(K)), StsEntry(1.0, tuple(reversed(_sts(K))), (0.4,) * K))
    calibrated = random_drafter(dataclasses.replace(raw.config, sts_by_temperature=table))
    calibrated.load_state_dict(raw.state_dict())
    inv, bias = calibrated.config.sts_table.at(np.array(TEMPERATURES))
    assert not np.allclose(inv[2], inv[1])  # the fits differ: a wrong pick would show
    for sample in (False, True):
        (da, ra), (db, rb) = _drafter(raw, target, ctx, sample), _drafter(calibrated, target, ctx, sample)
        pa, pb = da.propose(ra), db.propose(rb)
        assert pa.token_ids == pb.token_ids and pa.confidences is not None and pb.confidences is not None
        z = torch.logit(pa.confidences.double())
        expected = torch.sigmoid(z * torch.from_numpy(inv) + torch.from_numpy(bias))
        torch.testing.assert_close(pb.confidences.double(), expected, rtol=0, atol=1e-5)


def _deepspec_keys(num_layers: int, learned_mask: bool) -> set[str]:
    keys = {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    }
    for i in range(num_layers):
        keys |= {f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
        keys |= {
            f"layers.{i}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        }
        keys |= {f"layers.{i}.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    return keys | ({"mask_embedding"} if learned_mask else set())


@pytest.mark.parametrize("variant", ["learned_mask", "mask_token"])
def test_save_load_round_trip(
    tmp_path: Path, targets: dict[str, CausalLM], contexts: dict[str, Context], variant: str
) -> None:
    target = targets["llama"]
    model = _drafter_model(target, variant, seed=4)
    out = save_drafter(model, tmp_path / "drafter")

    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DSparkDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["block_size"] == K and raw["num_hidden_layers"] == 2 and raw["num_target_layers"] == TARGET_LAYERS
    assert raw["hidden_size"] == 64 and raw["vocab_size"] == V and raw["head_dim"] == target.config.head_dim
    own = raw["dspark_config"]
    assert own["target_layer_ids"] == [1, 3] and own["markov_rank"] == 8 and own["confidence_head"] is True
    assert own["mask_token_id"] == (MASK_ID if variant == "mask_token" else None)
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == _deepspec_keys(2, learned_mask=variant == "learned_mask")  # no prefix, no embed/lm_head
    assert tensors["markov_head.markov_w1.weight"].shape == (V, 8)
    assert tensors["markov_head.markov_w2.weight"].shape == (V, 8)
    assert tensors["confidence_head.proj.weight"].shape == (1, 64 + 8)
    assert tensors["fc.weight"].shape == (64, 2 * 64)

    loaded = load_drafter(out, target.config, F32, CPU)
    assert loaded.config == model.config
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name
    _same_proposals(model, loaded, target, contexts["llama"])


def _dflash_config(cfg: DSparkConfig, **extra: Any) -> dict[str, Any]:
    """A config.json as DFlash / DeepSpec write it: the drafter's own keys under "dflash_config", no markov_rank."""
    raw = cfg.to_json()
    raw.pop("dspark_config")
    raw.pop("num_target_layers")
    return {
        **raw,
        "architectures": ["DFlashDraftModel"],
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id},
        **extra,
    }


def test_dflash_style_config_loads(tmp_path: Path, targets: dict[str, CausalLM], contexts: dict[str, Context]) -> None:
    target = targets["qwen3"]
    model = _drafter_model(target, "mask_token", seed=5)
    out = save_drafter(model, tmp_path / "dflash")
    (out / "config.json").write_text(json.dumps(_dflash_config(model.config, num_target_layers=TARGET_LAYERS)))
    loaded = load_drafter(out, target.config, F32, CPU)
    cfg = loaded.config
    assert cfg.markov_rank == 8  # from markov_head.markov_w1.weight's shape
    assert cfg.mask_token_id == MASK_ID and cfg.target_layer_ids == (1, 3) and cfg.block_size == K
    assert cfg.num_target_layers == TARGET_LAYERS and cfg.confidence_head
    assert cfg.sts_temperatures is None and cfg.sts_biases is None
    assert not hasattr(loaded, "mask_embedding")
    for name, t in model.state_dict().items():
        assert torch.equal(t, loaded.state_dict()[name]), name
    plain = random_drafter(dataclasses.replace(model.config, sts_temperatures=None, sts_biases=None))
    plain.load_state_dict(model.state_dict())
    _same_proposals(plain, loaded, target, contexts["qwen3"])


def test_dflash_config_without_num_target_layers_loads(tmp_path: Path, targets: dict[str, CausalLM]) -> None:
    """Without num_target_layers, a drafter tapping the documented layers 1..L-3 of an L-layer target still fits it:
    the last tapped layer is L-3 (docs/drafter.md, default_target_layer_ids, DFlash's own configs)."""
    target = targets["llama"]
    model = _drafter_model(target, "mask_token", seed=6)
    assert model.config.target_layer_ids[-1] == TARGET_LAYERS - 3
    out = save_drafter(model, tmp_path / "dflash")
    (out / "config.json").write_text(json.dumps(_dflash_config(model.config)))
    loaded = load_drafter(out, target.config, F32, CPU)
    assert loaded.config.target_layer_ids == (1, 3)


def _save_with(target: CausalLM, directory: Path, **changes: Any) -> Path:
    return save_drafter(random_drafter(dataclasses.replace(_drafter_config(target), **changes)), directory)


def _edit_tensors(directory: Path, edit: Any) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def _edit_config(directory: Path, edit: Any) -> None:
    raw = json.loads((directory / "config.json").read_text())
    edit(raw)
    (directory / "config.json").write_text(json.dumps(raw))


def _truncate(file: Path, size: int) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: size if size >= 0 else len(data) // 2])


BAD_DRAFTERS: dict[str, tuple[Any, str, str]] = {
    # name: (make the bad drafter from a good one's directory d; what the error names ("" for d, or a file in d);
    # the problem it states)
    "another vocabulary": (
        lambda t, d: _save_with(t, d, vocab_size=32000),
        "",
        "made for another target: vocab_size 32000 != the target's 49152",
    ),
    "another hidden size": (
        lambda t, d: _save_with(t, d, hidden_size=32),
        "",
        "made for another target: hidden_size 32 != the target's 64",
    ),
    "another layer count": (
        lambda t, d: _save_with(t, d, num_target_layers=8),
        "",
        "made for another target: num_target_layers 8 != the target's 6 layers",
    ),
    "taps past the target": (
        lambda t, d: _save_with(t, d, num_target_layers=12, target_layer_ids=(1, 9)),
        "",
        r"num_target_layers 12 != the target's 6 layers; target_layer_ids \[1, 9\] reach past the target's layers",
    ),
    "missing tensor": (
        lambda t, d: _edit_tensors(_save_with(t, d), lambda ts: ts.pop("layers.1.mlp.down_proj.weight")),
        "",
        "missing tensors layers.1.mlp.down_proj.weight",
    ),
    "unexpected tensor": (
        lambda t, d: _edit_tensors(_save_with(t, d), lambda ts: ts.update({"layers.2.norm.weight": torch.ones(64)})),
        "model.safetensors",
        "unexpected tensors layers.2.norm.weight",
    ),
    "wrong shape": (
        lambda t, d: _edit_tensors(_save_with(t, d), lambda ts: ts.update({"fc.weight": torch.zeros(64, 64)})),
        "model.safetensors",
        r"tensor 'fc.weight' has shape \(64, 64\), the config implies \(64, 128\)",
    ),
    "rank disagrees with the tensors": (
        lambda t, d: _edit_config(_save_with(t, d), lambda c: c["dspark_config"].update(markov_rank=16)),
        "model.safetensors",
        r"tensor 'markov_head.markov_w1.weight' has shape \(49152, 8\), the config implies \(49152, 16\)",
    ),
    "config is not JSON": (
        lambda t, d: (_save_with(t, d) / "config.json").write_text('{"hidden_size": 64,'),
        "config.json",
        "cannot be read",
    ),
    "no config.json": (
        lambda t, d: (_save_with(t, d) / "config.json").unlink(),
        "config.json",
        "cannot be read",
    ),
    "config lacks target_layer_ids": (
        lambda t, d: _edit_config(_save_with(t, d), lambda c: c["dspark_config"].pop("target_layer_ids")),
        "config.json",
        "lacks the key 'target_layer_ids'",
    ),
    # No rank in the config and no W1 to read it from: a drafter without a Markov head, so W2 is left over.
    "no markov_rank anywhere": (
        lambda t, d: (
            _edit_config(_save_with(t, d), lambda c: c["dspark_config"].pop("markov_rank")),
            _edit_tensors(d, lambda ts: ts.pop("markov_head.markov_w1.weight")),
        ),
        "model.safetensors",
        "unexpected tensors markov_head.markov_w2.weight",
    ),
    "config is a list": (
        lambda t, d: (_save_with(t, d) / "config.json").write_text("[1, 2]"),
        "config.json",
        "must hold a JSON object",
    ),
    "no safetensors": (
        lambda t, d: (_save_with(t, d) / "model.safetensors").unlink(),
        "",
        r"no \*.safetensors files",
    ),
    "truncated safetensors": (
        lambda t, d: _truncate(_save_with(t, d) / "model.safetensors", -1),
        "model.safetensors",
        "not a readable safetensors file",
    ),
    "safetensors cut inside its header": (
        lambda t, d: _truncate(_save_with(t, d) / "model.safetensors", 5),
        "model.safetensors",
        "not a readable safetensors file",
    ),
}


@pytest.mark.parametrize("case", list(BAD_DRAFTERS))
def test_bad_drafters_raise_a_clear_error(tmp_path: Path, targets: dict[str, CausalLM], case: str) -> None:
    make, named, problem = BAD_DRAFTERS[case]
    directory = tmp_path / "drafter"
    make(targets["llama"], directory)
    where = directory / named if named else directory
    with pytest.raises(ModelLoadError, match=re.escape(str(where)) + ": .*" + problem):
        load_drafter(directory, targets["llama"].config, F32, CPU)


def test_a_path_that_is_not_a_directory(tmp_path: Path, targets: dict[str, CausalLM]) -> None:
    out = _save_with(targets["llama"], tmp_path / "drafter")
    for path in (out / "model.safetensors", tmp_path / "nowhere"):
        with pytest.raises(ModelLoadError, match=re.escape(str(path)) + ": a DSpark drafter is a directory"):
            load_drafter(path, targets["llama"].config, F32, CPU)


# ---- 4. a random drafter for any target --------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_random_drafter_fits_every_family(tiny_model_dirs: dict[str, Path], family: str) -> None:
    target = load_model(tiny_model_dirs[family], F32, CPU)
    tc = target.config
    cfg = DSparkConfig.for_target(tc)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        tc.vocab_size,
        tc.hidden_size,
        tc.num_heads,
        tc.num_kv_heads,
        tc.head_dim,
    )
    assert cfg.num_target_layers == tc.num_layers == 2 and cfg.target_layer_ids == (1,)
    model = random_drafter(cfg, seed=0)
    for a, b in zip(model.state_dict().values(), random_drafter(cfg, seed=0).state_dict().values(), strict=True):
        assert torch.equal(a, b)  # seeded
    cfg.check_target(tc, "here")
    tokens = list(range(100, 140))
    drafter = DSparkDrafter(model, target, cfg.block_size, True, 16, PAGE, CPU, F32)
    blocks = [9, 2, 14, 5, 0, 11, 7, 3, 15, 12, 1, 6]  # 40 - 1 + 7 positions
    a = len(tokens) - 1
    drafter.extend_context(
        _target_taps(target, tokens[:-1], cfg.target_layer_ids),
        torch.arange(a),
        torch.tensor(slots_for(blocks, 0, a, PAGE)),
    )
    req = Request("r", None, tokens, SamplingParams(temperature=0.8), seed=1, eos_token_id=None)
    req.num_computed_tokens, req.block_ids = a, blocks
    proposal = drafter.propose([req])
    assert len(proposal.token_ids[0]) == cfg.block_size and all(0 <= t < tc.vocab_size for t in proposal.token_ids[0])
    assert proposal.probs is not None and proposal.probs.shape == (1, cfg.block_size, tc.vocab_size)
    torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(1, cfg.block_size))
    assert proposal.confidences is not None and bool(((proposal.confidences > 0) & (proposal.confidences < 1)).all())


def test_default_target_layer_ids() -> None:
    assert default_target_layer_ids(30, 3) == (1, 14, 27)  # SmolLM2: early, middle and late
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # DFlash's Qwen3-8B drafters
    assert default_target_layer_ids(2, 1) == (1,)
    assert default_target_layer_ids(2, 3) == (1,)  # too few layers: fewer taps, still valid
    for layers in range(2, 64):
        for taps in range(1, 6):
            ids = default_target_layer_ids(layers, taps)
            assert list(ids) == sorted(set(ids)) and 1 <= len(ids) <= taps, (layers, taps, ids)
            assert 0 <= ids[0] and ids[-1] < layers
            if layers >= 4:
                assert 1 <= ids[0] and ids[-1] <= layers - 3, (layers, taps, ids)
            if layers >= taps + 3:  # room for every tap
                assert len(ids) == taps, (layers, taps, ids)
                if taps > 1:
                    assert ids[0] == 1 and ids[-1] == layers - 3


def test_default_target_layer_ids_fit_a_one_layer_target() -> None:
    """Every count of taps gives a valid layer of a one-layer target (two taps already give layer 0)."""
    assert default_target_layer_ids(1, 2) == (0,)
    assert default_target_layer_ids(1, 1) == (0,)


# ---- 5. engine validation ----------------------------------------------------------------------------------------


def _llm(model: Path, spec: dict[str, Any]) -> LLM:
    return LLM(model=str(model), dtype="float32", num_kv_blocks=64, max_model_len=256, speculative_config=spec)


@pytest.fixture(scope="module")
def llama_drafter(tmp_path_factory: pytest.TempPathFactory, tiny_model_dirs: dict[str, Path]) -> Path:
    cfg = DSparkConfig.for_target(load_config(tiny_model_dirs["llama"]), block_size=4, num_taps=1, markov_rank=4)
    return save_drafter(random_drafter(cfg), tmp_path_factory.mktemp("llama-drafter"))


def test_engine_accepts_a_fitting_drafter(tiny_model_dirs: dict[str, Path], llama_drafter: Path) -> None:
    llm = _llm(tiny_model_dirs["llama"], {"method": "dspark", "model": str(llama_drafter)})
    assert llm.engine.num_spec_tokens == 4  # the drafter's block size
    llm = _llm(tiny_model_dirs["llama"], {"method": "dspark", "model": str(llama_drafter), "num_speculative_tokens": 3})
    assert llm.engine.num_spec_tokens == 3


def test_engine_rejects_more_drafts_than_the_block(tiny_model_dirs: dict[str, Path], llama_drafter: Path) -> None:
    spec = {"method": "dspark", "model": str(llama_drafter), "num_speculative_tokens": 5}
    with pytest.raises(ConfigError, match="block size, 4") as e:
        _llm(tiny_model_dirs["llama"], spec)
    assert e.value.field == "speculative_config.num_speculative_tokens" and e.value.value == 5


def test_engine_needs_a_drafter_for_dspark(tiny_model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="drafter directory") as e:
        _llm(tiny_model_dirs["llama"], {"method": "dspark", "num_speculative_tokens": 3})
    assert e.value.field == "speculative_config.model"


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"num_layers": 4}, "num_target_layers 4 != the target's 2 layers"),
        ({"vocab_size": 32000}, "vocab_size 32000 != the target's 49152"),
    ],
)
def test_engine_rejects_a_drafter_for_another_target(
    tmp_path: Path, tiny_model_dirs: dict[str, Path], changes: dict[str, Any], problem: str
) -> None:
    """A drafter made for a (4-layer, or other-vocabulary) Qwen3: the tiny Qwen3 and Llama share hidden size 64."""
    other = dataclasses.replace(load_config(tiny_model_dirs["qwen3"]), **changes)
    cfg = DSparkConfig.for_target(other, block_size=4, num_taps=2, markov_rank=4)
    out = save_drafter(random_drafter(cfg), tmp_path / "qwen3-drafter")
    with pytest.raises(
        ModelLoadError,
        match=re.escape(f"{out}: this drafter was made for another target: ") + ".*" + re.escape(problem),
    ):
        _llm(tiny_model_dirs["llama"], {"method": "dspark", "model": str(out)})


def test_a_drafter_without_markov_and_confidence_heads(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> None:
    """DeepSpec's flat layout with "markov_rank": 0 and "enable_confidence_head": false (the DFlash-style ablation):
    it loads without those tensors, drafts from the backbone alone, reports no confidences, and changes no greedy
    token."""
    target_dir = tiny_model_dirs["llama"]
    cfg = DSparkConfig.for_target(
        load_config(target_dir), block_size=4, num_taps=2, markov_rank=0, confidence_head=False
    )
    out = save_drafter(random_drafter(cfg), tmp_path / "plain")
    raw = json.loads((out / "config.json").read_text())
    own = raw.pop("dspark_config")
    own.pop("confidence_head")
    (out / "config.json").write_text(json.dumps({**raw, **own, "enable_confidence_head": False}))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert not any(k.startswith(("markov_head", "confidence_head")) for k in f.keys())

    prompts = [[5, 6, 7, 8, 5, 6, 7], list(range(100, 160))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in _llm(target_dir, None).generate(prompts, params)]
    # Fixed k: every draft verified (adaptive verification would soon stop verifying an untrained drafter's drafts).
    llm = _llm(target_dir, {"method": "dspark", "model": str(out), "enable_adaptive_verification": False})
    assert llm.engine.dspark_model is not None and llm.engine.dspark_model.markov_head is None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0


def test_drafter_positions_follow_the_target_not_its_own_config(
    tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    """A drafter whose config says max_position_embeddings=32 still drafts at position 200 of a 1024-token target."""
    target_dir = tiny_model_dirs["llama"]
    cfg = dataclasses.replace(
        DSparkConfig.for_target(load_config(target_dir), block_size=4, num_taps=2, markov_rank=4),
        max_position_embeddings=32,
    )
    out = save_drafter(random_drafter(cfg), tmp_path / "short")
    prompt = list(range(300, 500))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = _llm(target_dir, None).generate([prompt], params)[0].outputs[0].token_ids
    llm = _llm(target_dir, {"method": "dspark", "model": str(out)})
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == reference


def test_a_config_silent_on_heads_follows_the_tensors(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> None:
    """DFlash configs name neither head: no confidence_head.* tensors means no confidence head (not a load error)."""
    target = load_config(tiny_model_dirs["llama"])
    cfg = DSparkConfig.for_target(target, block_size=4, num_taps=2, markov_rank=4, confidence_head=False)
    out = save_drafter(random_drafter(cfg), tmp_path / "dflash")
    (out / "config.json").write_text(json.dumps(_dflash_config(cfg)))
    loaded = load_drafter(out, target, F32, CPU)
    assert loaded.config.confidence_head is False and loaded.confidence_head is None
    assert loaded.config.markov_rank == 4 and loaded.config.num_target_layers is None
