"""The fused Triton kernels (models/fused_ops.py) against their torch twins in models/llama.py, and the fused
CausalLM forward (fused kernels, residual adds inside the norms, merged q/k/v and gate/up GEMMs) against the torch path.

On CPU the kernels run under the Triton interpreter, in one subprocess (this file run as a script): TRITON_INTERPRET=1
must be set before triton.jit decorates them and would turn every kernel of the process into an interpreted one.
With CUDA the same cases run on the GPU, plus SmolLM2-shaped ones, a CUDA-graph capture and a kernel count.

fp32 must agree up to summation order; bf16 within one rounding of the dtype and bit for bit almost everywhere
(the kernels round at the same points as the torch code; only reduction order and exp's last bit differ).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dspark.attention.base import AttentionContext, AttentionMetadata, KVCache
from dspark.attention.torch_ref import TorchAttention
from dspark.models import fused_ops
from dspark.models.config import ModelConfig
from dspark.models.llama import CausalLM, RMSNorm, Rotary, apply_rotary
from helpers import interpreted_verdicts, run_interpreted

REPO = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---- comparisons and references -------------------------------------------------------------------------------------


def assert_matches(
    got: torch.Tensor, want: torch.Tensor, what: str, ulps: int = 1, rounded: bool | None = None
) -> None:
    """fp32: equal up to summation order. bf16 (or `rounded`: computed through a bf16 rounding): within `ulps`
    roundings, measured against the element plus the tensor's mean magnitude (a last-bit difference before a
    cancellation, as in rotary's x * cos - y * sin, is an ulp of the inputs, not of the result), and bit-identical
    almost everywhere: rounding at other points than the torch code would break that."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype} vs {want.dtype}"
    if not (got.dtype == torch.bfloat16 if rounded is None else rounded):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
        return
    g, w = got.float(), want.float()
    bad = (g - w).abs() > (w.abs() + w.abs().mean()) * 2.0**-7 * ulps
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off by more than {ulps} ulp: {g[bad][:4]} vs {w[bad][:4]}"
    same = (got == want).float().mean().item()
    assert same >= 0.99, f"{what}: only {same:.2%} bit-identical"


def assert_close_model(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Fused against torch path after several layers. bf16: one rounding that differs (a GEMM's summation order, exp's
    last bit) moves later values by an ulp here and there, so the bound follows the tensor's scale (a random
    SmolLM2-shaped model's residual stream reaches ~60, where one ulp is 0.25), and the mean must stay far smaller."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype} vs {want.dtype}"
    if got.dtype == torch.float32:
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{what}: {m}")
        return
    g, w = got.float(), want.float()
    torch.testing.assert_close(g, w, rtol=2**-6, atol=2**-6 * w.abs().max().item(), msg=lambda m: f"{what}: {m}")
    mean_diff, mean = (g - w).abs().mean().item(), w.abs().mean().item()
    assert mean_diff <= 2**-9 * mean, f"{what}: mean difference {mean_diff:.3e} for a mean magnitude {mean:.3e}"


def randn(
    *shape: int, g: torch.Generator, dtype: torch.dtype, device: torch.device, scale: float = 1.0
) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight = torch.nn.Parameter(weight, requires_grad=False)
    with fused_ops.forced(False):
        return norm(x)


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    with fused_ops.forced(False):
        return apply_rotary(x, (cos, sin))


def torch_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gate / (1 + torch.exp(-gate)) * up  # MLP.forward's activation


def rope(n: int, head_dim: int, device: torch.device, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = Rotary(head_dim, 10000.0, 4096).to(device)
    return rotary(torch.randint(0, 4096, (n,), generator=g).to(device))


# ---- kernel cases ---------------------------------------------------------------------------------------------------


def check_rms_norm(dtype: torch.dtype, device: torch.device, rows: int = 7) -> None:
    g = torch.Generator().manual_seed(0)
    for dim in (576, 960, 64, 100):
        wide = randn(rows, dim + 32, g=g, dtype=dtype, device=device)
        x = wide[:, 16 : 16 + dim]  # strided rows
        w = randn(dim, g=g, dtype=dtype, device=device, scale=0.1) + 1
        got = fused_ops.rms_norm(x, w, 1e-5)
        assert_matches(got, torch_norm(x, w, 1e-5), f"rms_norm dim={dim}")
        # Row by row: a row's bits do not depend on the rows beside it.
        assert torch.equal(fused_ops.rms_norm(x[2:5], w, 1e-5), got[2:5]), f"rms_norm dim={dim}: not batch-invariant"
        if dtype == torch.bfloat16:  # an fp32 weight on bf16 rows promotes, as in torch
            want = torch_norm(x, w.float(), 1e-5)
            assert_matches(fused_ops.rms_norm(x, w.float(), 1e-5), want, "promoted", rounded=True)
    assert fused_ops.rms_norm(x[:0], w, 1e-5).shape == (0, x.shape[1])


def check_add_rms_norm(dtype: torch.dtype, device: torch.device, rows: int = 7) -> None:
    g = torch.Generator().manual_seed(1)
    for dim in (576, 960, 2048):
        x, res = (randn(rows, dim, g=g, dtype=dtype, device=device, scale=s) for s in (1.0, 4.0))
        w = randn(dim, g=g, dtype=dtype, device=device, scale=0.1) + 1
        x_before, res_before = x.clone(), res.clone()
        normed, new_res = fused_ops.add_rms_norm(x, res, w, 1e-6)
        assert torch.equal(new_res, res + x), f"add_rms_norm dim={dim}: the residual sum differs from x + residual"
        assert_matches(normed, torch_norm(res + x, w, 1e-6), f"add_rms_norm dim={dim}")
        assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs were modified"


def check_per_head_norm(dtype: torch.dtype, device: torch.device, rows: int = 5) -> None:
    """Qwen3's q/k norms: rows of head_dim inside a [n, heads, head_dim] view of a merged qkv output."""
    g = torch.Generator().manual_seed(2)
    for heads, head_dim in ((9, 64), (4, 24)):
        qkv = randn(rows, (heads + 2) * head_dim, g=g, dtype=dtype, device=device)
        q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
        w = randn(head_dim, g=g, dtype=dtype, device=device, scale=0.1) + 1
        assert_matches(fused_ops.rms_norm(q, w, 1e-6), torch_norm(q, w, 1e-6), f"per-head norm {heads}x{head_dim}")


def check_rotary(dtype: torch.dtype, device: torch.device, rows: int = 6) -> None:
    g = torch.Generator().manual_seed(3)
    for hq, hk, head_dim, qk_norm in ((9, 3, 64, False), (9, 3, 64, True), (4, 2, 24, True), (8, 8, 128, False)):
        cos, sin = rope(rows, head_dim, device, g)
        qkv = randn(rows, (hq + 2 * hk) * head_dim, g=g, dtype=dtype, device=device)
        before = qkv.clone()
        q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
        q, k, v = q.view(rows, hq, head_dim), k.view(rows, hk, head_dim), v.view(rows, hk, head_dim)
        want_q, want_k = q.clone(), k.clone()
        norm = None
        if qk_norm:
            wq, wk = (randn(head_dim, g=g, dtype=dtype, device=device, scale=0.1) + 1 for _ in "qk")
            norm = (wq, wk, 1e-6)
            want_q, want_k = torch_norm(want_q, wq, 1e-6), torch_norm(want_k, wk, 1e-6)
        want_q, want_k = torch_rotary(want_q, cos, sin), torch_rotary(want_k, cos, sin)
        what = f"rotary_qk {hq}/{hk}x{head_dim}{' qk_norm' if qk_norm else ''}"
        got_q, got_k = fused_ops.rotary_qk(q, k, cos, sin, norm)
        assert got_q is q and got_k is k, f"{what}: not in place"
        assert_matches(q, want_q, f"{what}: q")
        assert_matches(k, want_k, f"{what}: k")
        assert torch.equal(v, before[:, (hq + hk) * head_dim :].view_as(v)), f"{what}: v was touched"
        x = before[:, : hq * head_dim].view(rows, hq, head_dim)
        out = fused_ops.rotary(x, cos, sin)
        assert_matches(out, torch_rotary(x, cos, sin), f"rotary {hq}x{head_dim}")
        assert torch.equal(x, before[:, : hq * head_dim].view_as(x)), "rotary(): the input was modified"


def check_silu_mul(dtype: torch.dtype, device: torch.device, rows: int = 5) -> None:
    g = torch.Generator().manual_seed(4)
    for width in (1536, 160, 2500):
        gate_up = randn(rows, 2 * width, g=g, dtype=dtype, device=device, scale=3.0)
        gate, up = gate_up[:, :width], gate_up[:, width:]
        want = torch_silu_mul(gate, up)
        # Intermediate roundings can carry a last-bit difference of exp through three more roundings.
        assert_matches(fused_ops.silu_mul(gate_up), want, f"silu_mul merged width={width}", ulps=2)
        assert_matches(fused_ops.silu_mul(gate.contiguous(), up.contiguous()), want, f"silu_mul width={width}", ulps=2)


# ---- the whole model ------------------------------------------------------------------------------------------------

MODELS = {
    "llama": dict(family="llama"),
    "llama-bias": dict(family="llama", attention_bias=True),  # o_proj has a bias too
    "qwen2": dict(family="qwen2", attention_bias=True),
    "qwen3": dict(family="qwen3", qk_norm=True, head_dim=24),  # half of 24 is no power of two
}
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5)
BLOCK_SIZE = 16


def make_config(family: str, **overrides: object) -> ModelConfig:
    kw: dict[str, object] = dict(
        family=family,
        vocab_size=256,
        hidden_size=96,
        intermediate_size=160,
        num_layers=3,
        num_heads=3,
        num_kv_heads=1,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
    )
    kw.update(overrides)
    return ModelConfig(**kw)  # type: ignore[arg-type]


def make_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> CausalLM:
    """Random weights, norm weights and biases included (all-ones norms would hide a misplaced weight)."""
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.1)
    model = model.to(device, dtype).eval()
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings).to(device)  # fp32, as loaded
    return model


def make_step(
    reqs: list[tuple[int, int]], device: torch.device
) -> tuple[AttentionMetadata, torch.Tensor]:  # (seq_len after the step, query length) per request; block r is r's
    slots, positions, starts = [], [], [0]
    for r, (seq, n) in enumerate(reqs):
        positions += range(seq - n, seq)
        slots += [r * BLOCK_SIZE + p for p in range(seq - n, seq)]
        starts.append(starts[-1] + n)
    lens = [seq for seq, _ in reqs]
    meta = AttentionMetadata(
        num_actual_tokens=starts[-1],
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.arange(len(reqs), dtype=torch.int32, device=device)[:, None],
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
        max_query_len=max(n for _, n in reqs),
        max_seq_len=max(lens),
    )
    return meta, torch.tensor(positions, device=device)


def new_caches(cfg: ModelConfig, num_reqs: int, dtype: torch.dtype, device: torch.device) -> list[KVCache]:
    shape = (num_reqs, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    return [KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]  # fmt: skip


STEPS = [[(5, 5), (7, 7), (1, 1)], [(6, 1), (10, 3), (2, 1)]]  # a prefill, then decodes and a verification


def run_steps(
    model: CausalLM, fused: bool, tap_layers: tuple[int, ...], device: torch.device
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[KVCache]]:
    """Hidden states and taps of every step of STEPS, and the caches after them."""
    cfg = model.config
    caches = new_caches(cfg, len(STEPS[0]), next(model.parameters()).dtype, device)
    g = torch.Generator().manual_seed(5)
    outs = []
    with fused_ops.forced(fused), torch.inference_mode():
        for reqs in STEPS:
            meta, positions = make_step(reqs, device)
            backend = TorchAttention()
            backend.prepare(meta, cfg.num_kv_heads, cfg.num_heads, BLOCK_SIZE)
            ids = torch.randint(0, cfg.vocab_size, positions.shape, generator=g).to(device)
            hidden, taps = model.forward_with_taps(ids, positions, AttentionContext(backend, meta, caches), tap_layers)
            assert taps is not None
            outs.append((hidden, taps))
    return outs, caches


def check_model(name: str, dtype: torch.dtype, device: torch.device, **overrides: object) -> None:
    """Fused forwards, with and without merged weights, against the torch path: final states, taps (a middle layer
    and the last: both come out of a fused add), the KV caches written, and one DecoderLayer.forward (the drafter's
    entry point)."""
    kw = {**MODELS[name], **overrides}
    cfg = make_config(kw.pop("family"), **kw)  # type: ignore[arg-type]
    model = make_model(cfg, dtype, device)
    taps = (0, cfg.num_layers - 1)
    want, want_caches = run_steps(model, False, taps, device)
    for merged in (False, True):
        if merged:
            model.fuse_weights()
        got, got_caches = run_steps(model, True, taps, device)
        for step, ((h, t), (wh, wt)) in enumerate(zip(got, want, strict=True)):
            what = f"{name} merged={merged} step {step}"
            assert_close_model(h, wh, f"{what} hidden")
            assert_close_model(t, wt, f"{what} taps")
        for i, (c, wc) in enumerate(zip(got_caches, want_caches, strict=True)):
            assert_close_model(c.key, wc.key, f"{name} merged={merged} layer {i} keys")
            assert_close_model(c.value, wc.value, f"{name} merged={merged} layer {i} values")

    # One layer through DecoderLayer.forward, as the drafter calls it.
    g = torch.Generator().manual_seed(6)
    meta, positions = make_step(STEPS[0], device)
    x = randn(positions.shape[0], cfg.hidden_size, g=g, dtype=dtype, device=device)
    outs = []
    for fused in (False, True):
        backend = TorchAttention()
        backend.prepare(meta, cfg.num_kv_heads, cfg.num_heads, BLOCK_SIZE)
        ctx = AttentionContext(backend, meta, new_caches(cfg, len(STEPS[0]), dtype, device))
        with fused_ops.forced(fused), torch.inference_mode():
            outs.append(model.model.layers[1](x, model.rotary(positions), ctx))
    assert_close_model(outs[1], outs[0], f"{name} DecoderLayer.forward")


KERNEL_CHECKS: dict[str, Callable[..., None]] = {
    "rms_norm": check_rms_norm,
    "add_rms_norm": check_add_rms_norm,
    "per_head_norm": check_per_head_norm,
    "rotary": check_rotary,
    "silu_mul": check_silu_mul,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES: dict[str, Callable[[torch.device], None]] = {
    **{f"{k}-{d}": (lambda dev, f=f, dt=dt: f(dt, dev)) for k, f in KERNEL_CHECKS.items() for d, dt in DTYPES.items()},
    **{f"model-{m}-{d}": (lambda dev, m=m, dt=dt: check_model(m, dt, dev)) for m in MODELS for d, dt in DTYPES.items()},
}


# ---- CPU: the Triton interpreter, in a subprocess -------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreted(request: pytest.FixtureRequest) -> dict[str, str]:
    """Verdicts of the selected interpreter cases, all computed in one subprocess."""
    return interpreted_verdicts(request, "test_interpreted_kernels_match_torch", __file__)


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernels_match_torch(interpreted: dict[str, str], name: str) -> None:
    assert interpreted[name] == "ok", interpreted[name]


# ---- CPU: fuse_weights and the dispatch (no triton needed) ---------------------------------------------------------


def test_fuse_weights_keeps_names_and_shares_storage() -> None:
    cfg = make_config("qwen2", attention_bias=True)
    model = make_model(cfg, torch.float32, torch.device("cpu"))
    keys = list(model.state_dict())
    model.fuse_weights()
    assert list(model.state_dict()) == keys, "fuse_weights changed the state_dict"
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_weight is not None and attn.qkv_bias is not None and mlp.gate_up_weight is not None
    assert attn.qkv_weight.shape == ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)
    assert torch.equal(attn.qkv_weight[: attn.q_proj.out_features], attn.q_proj.weight)
    assert torch.equal(attn.qkv_bias[-attn.v_proj.out_features :], attn.v_proj.bias)
    # Views, not copies: loading weights afterwards updates the merged GEMM's too.
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert torch.equal(attn.qkv_weight[attn.q_proj.out_features :][: attn.k_proj.out_features], attn.k_proj.weight)
    assert torch.equal(mlp.gate_up_weight[cfg.intermediate_size :], state["model.layers.0.mlp.up_proj.weight"])


def test_cpu_path_is_untouched_by_fuse_weights() -> None:
    """On CPU the fused path is off and fuse_weights() changes no bit (the exactness tests rely on it)."""
    cfg = make_config("qwen3", qk_norm=True, head_dim=24)
    model = make_model(cfg, torch.float32, torch.device("cpu"))
    assert not fused_ops.enabled(torch.zeros(1))
    before, before_caches = run_steps(model, False, (0, 2), torch.device("cpu"))
    model.fuse_weights()
    with fused_ops.forced(False):  # no-op here, but explicit
        after, after_caches = run_steps(model, False, (0, 2), torch.device("cpu"))
    for (h, t), (h2, t2) in zip(before, after, strict=True):
        assert torch.equal(h, h2) and torch.equal(t, t2)
    assert all(torch.equal(a.key, b.key) for a, b in zip(before_caches, after_caches, strict=True))


# ---- GPU ------------------------------------------------------------------------------------------------------------

GPU_CASES: dict[str, Callable[[torch.device], None]] = {
    **CASES,
    **{f"{k}-bf16-rows1000": (lambda dev, f=f: f(torch.bfloat16, dev, 1000)) for k, f in KERNEL_CHECKS.items()},
    "model-smollm2-bf16": lambda dev: check_model("llama", torch.bfloat16, dev, **SMOLLM2),
    "model-smollm2-fp32": lambda dev: check_model("llama", torch.float32, dev, **SMOLLM2),
    "model-qwen3-d128-bf16": lambda dev: check_model("qwen3", torch.bfloat16, dev, num_heads=4, head_dim=128),
}


@needs_triton
@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_kernels_match_torch(name: str) -> None:
    GPU_CASES[name](torch.device("cuda"))


def _decode_graph_setup(
    num_layers: int, num_reqs: int, max_len: int = 1024
) -> tuple[list[KVCache], Callable[[int], None], Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """A SmolLM2-shaped bf16 model with merged weights, the Triton backend and static decode buffers."""
    from dspark.attention.triton_backend import TritonAttention

    dev = torch.device("cuda")
    cfg = make_config("llama", **{**SMOLLM2, "num_layers": num_layers, "max_position_embeddings": max_len})
    model = make_model(cfg, torch.bfloat16, dev).fuse_weights()
    blocks_per_req = max_len // BLOCK_SIZE
    ids = torch.zeros(num_reqs, dtype=torch.int64, device=dev)
    pos = torch.zeros(num_reqs, dtype=torch.int64, device=dev)
    meta = AttentionMetadata(
        num_actual_tokens=-1,
        slot_mapping=torch.zeros(num_reqs, dtype=torch.int64, device=dev),
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.zeros(num_reqs, dtype=torch.int32, device=dev),
        block_tables=torch.arange(num_reqs * blocks_per_req, dtype=torch.int32, device=dev).view(num_reqs, -1),
        query_start_loc_cpu=[],
        seq_lens_cpu=[],
        max_query_len=1,
        max_seq_len=max_len,
    )
    shape = (num_reqs * blocks_per_req, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    caches = [KVCache(*(torch.randn(shape, device=dev).to(torch.bfloat16) for _ in "kv")) for _ in range(num_layers)]
    backend = TritonAttention()

    def fill(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, max_len + 1, (num_reqs,), generator=g)
        ids.copy_(torch.randint(0, cfg.vocab_size, (num_reqs,), generator=g))
        pos.copy_(lens - 1)
        meta.seq_lens.copy_(lens)
        meta.slot_mapping.copy_(torch.arange(num_reqs) * max_len + lens - 1)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        backend.prepare(meta, cfg.num_kv_heads, cfg.num_heads, BLOCK_SIZE)
        hidden, taps = model.forward_with_taps(ids, pos, AttentionContext(backend, meta, caches), (0, num_layers - 1))
        assert taps is not None
        return hidden, taps

    return caches, fill, step


@needs_triton
@needs_cuda
@pytest.mark.gpu
def test_gpu_cuda_graph_of_the_fused_forward() -> None:
    """Capture a fused decode forward once; replays with other tokens, positions and lengths give the eager fused
    forward's bits (hidden, taps, caches) and stay close to the torch path."""
    caches, fill, step = _decode_graph_setup(num_layers=3, num_reqs=8)

    def snapshot() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(c.key.clone(), c.value.clone()) for c in caches]

    def restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for c, (k, v) in zip(caches, saved, strict=True):
            c.key.copy_(k)
            c.value.copy_(v)

    with torch.inference_mode():
        fill(0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compiles the kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                static_hidden, static_taps = step()
        torch.cuda.current_stream().wait_stream(stream)

        for seed in (1, 2, 3):
            fill(seed)
            before = snapshot()
            graph.replay()
            got = (static_hidden.clone(), static_taps.clone())
            got_caches = snapshot()
            restore(before)
            eager = step()
            assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1]), f"seed {seed}: replay != eager"
            assert all(
                torch.equal(a[0], c.key) and torch.equal(a[1], c.value) for a, c in zip(got_caches, caches, strict=True)
            )
            restore(before)
            with fused_ops.forced(False):
                ref = step()
            assert_close_model(got[0], ref[0], f"seed {seed} hidden")
            assert_close_model(got[1], ref[1], f"seed {seed} taps")


@needs_triton
@needs_cuda
@pytest.mark.gpu
def test_gpu_fused_decode_layer_kernel_count() -> None:
    """Kernels per decoder layer of a decode step (the difference between a 4- and a 2-layer model), fused and not."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def kernels(num_layers: int, fused: bool) -> int:
        _, fill, step = _decode_graph_setup(num_layers=num_layers, num_reqs=1)
        with torch.inference_mode(), fused_ops.forced(fused):
            fill(0)
            step()  # compile
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)

    per_layer = {}
    for fused in (True, False):
        two, four = kernels(2, fused), kernels(4, fused)
        if two == 0:
            pytest.skip("the profiler saw no kernels")
        per_layer[fused] = (four - two) / 2
    print(f"decode kernels per layer: fused {per_layer[True]:g}, torch path {per_layer[False]:g}")
    # norm, qkv GEMM, rotary, KV write, attention (+ split combine), o_proj, add+norm, gate_up GEMM, SiLU, down: 10-11,
    # plus whatever reduction kernels cuBLAS adds to its small-M GEMMs.
    assert per_layer[True] <= 14, f"{per_layer[True]} kernels per fused layer"
    assert per_layer[True] * 2.5 < per_layer[False], per_layer


if __name__ == "__main__":
    print(json.dumps(run_interpreted(lambda name: CASES[name](torch.device("cpu")), sys.argv[1:])))
