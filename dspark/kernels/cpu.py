"""The fast CPU path's fused kernels (cpu.c): RMSNorm with the residual add, rotary in place, SiLU-and-multiply,
attention of short queries (decode, verification, DSpark draft blocks) over the paged cache, bf16 prompt-chunk
attention on AVX512-BF16, argmax, and a DSpark block's greedy Markov-corrected argmax; built once per machine with the
C compiler and loaded by ctypes.

A decode step of the default model at batch 16 spent about half its time outside the GEMMs on CPU: ~50 torch ops
per layer (8 per RMSNorm, 8 for rotary, ~15 for attention's gathers, matmuls and masks), each a few microseconds of
dispatch and a pass over memory. Each kernel here is one call and one pass. The compiler flags keep torch's rounding
points (-ffp-contract=off); -march=native lets the compiler use this CPU's vector units, so the library is built
where it runs and cached under the dspark cache, keyed by the source and the CPU.

Without a C compiler (or with DSPARK_CPU_KERNELS=0) `lib()` is None and the torch formulas serve, as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from dspark.utils.platform import cache_dir

logger = logging.getLogger("dspark")

_SOURCE = Path(__file__).with_name("cpu.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _F, ctypes.c_int],
    "rotary": [_P, _I, _I, _I, _I, _P, _P, ctypes.c_int],
    "silu_mul": [_P, _P, _I, _I, ctypes.c_int],
    "paged_attention": [
        _P,
        _I,
        _P,
        _P,
        _I,
        _P,
        _P,
        _P,
        _P,
        _P,
        _I,
        _P,
        _P,
        _I,
        _I,
        _I,
        _I,
        _I,
        _F,
        ctypes.c_int,
        ctypes.c_int,
    ],
    "argmax": [_P, _I, _I, _I, _P, ctypes.c_int],
    "markov_block": [_P, _P, _I, _P, _P, _P, _F, _P, _I, _I, _I, _I, _P, _P, ctypes.c_int],
}


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "\n" + "\n".join(lines)


def _build(out: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # built aside, then renamed: no half-written library
        built = Path(tmp) / out.name
        subprocess.run([compiler, *FLAGS, str(_SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True)
        built.replace(out)


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built (logged once) or DSPARK_CPU_KERNELS=0."""
    if os.environ.get("DSPARK_CPU_KERNELS", "1") == "0":
        return None
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_id().encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    try:
        if not path.exists():
            _build(path)
        handle = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace")[-500:] if isinstance(e, subprocess.CalledProcessError) else e
        logger.warning("CPU kernels unavailable (%s); the CPU path runs torch ops instead", detail)
        return None
    for name, args in _SIGNATURES.items():
        for suffix in ("f32", "bf16"):
            fn = getattr(handle, f"{name}_{suffix}")
            fn.argtypes, fn.restype = args, None
    handle.prefill_attention_available.argtypes, handle.prefill_attention_available.restype = [], ctypes.c_int
    handle.prefill_attention_bf16.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, ctypes.c_int]
    handle.prefill_attention_bf16.restype = ctypes.c_int
    handle.small_linear_available.argtypes, handle.small_linear_available.restype = [], ctypes.c_int
    handle.small_linear_pack.argtypes, handle.small_linear_pack.restype = [_P, _I, _I, _P, ctypes.c_int], None
    handle.small_linear_bf16.argtypes = [_P, _I, _I, _P, _I, _I, _P, ctypes.c_int]
    handle.small_linear_bf16.restype = None
    return handle


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels take this tensor (CPU, fp32 or bf16, inference) and are built."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and not torch.is_grad_enabled()
        and lib() is not None
    )


def _fn(name: str, dtype: torch.dtype) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    return getattr(lib(), f"{name}_{'bf16' if dtype == torch.bfloat16 else 'f32'}")


def _rows(x: torch.Tensor) -> int:
    """The row stride of a [n, dim] tensor whose rows are contiguous."""
    assert x.dim() == 2 and x.stride(1) == 1, "rows must be contiguous"
    return x.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward's formula: [n, dim] -> [n, dim]."""
    h = torch.empty(x.shape, dtype=x.dtype)
    _fn("rms_norm", x.dtype)(
        x.data_ptr(),
        _rows(x),
        None,
        0,
        weight.data_ptr(),
        h.data_ptr(),
        None,
        x.shape[0],
        x.shape[1],
        eps,
        torch.get_num_threads(),
    )
    return h


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to the dtype first as torch's add would."""
    h, total = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    _fn("rms_norm", x.dtype)(
        residual.data_ptr(),
        _rows(residual),
        x.data_ptr(),
        _rows(x),
        weight.data_ptr(),
        h.data_ptr(),
        total.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
        torch.get_num_threads(),
    )
    return h, total


def rotary_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """apply_rotary in place: qk [n, heads, head_dim] (rows contiguous, any row stride); cos, sin: the rows'
    Rotary.forward values, fp32 [n, 1, head_dim] or [n, head_dim]."""
    n, heads, d = qk.shape
    assert qk.stride(2) == 1 and qk.stride(1) == d and cos.dtype == sin.dtype == torch.float32
    cos, sin = cos.reshape(n, d).contiguous(), sin.reshape(n, d).contiguous()
    _fn("rotary", qk.dtype)(
        qk.data_ptr(), qk.stride(0), n, heads, d, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up of a merged [n, 2 * inter] GEMM output (gate first), contiguous."""
    gate_up = gate_up.contiguous()
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype)
    _fn("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), n, inter, torch.get_num_threads())
    return out


def paged_attention(
    q: torch.Tensor,  # [tokens, H, D]: rows contiguous per head, any row stride
    k: torch.Tensor,  # [tokens, Hkv, D], as q
    v: torch.Tensor,  # [tokens, Hkv, D]
    key_cache: torch.Tensor,  # [blocks, block_size, Hkv, D] contiguous
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [>= tokens] int64
    query_start_loc: torch.Tensor,  # [requests + 1] int32: request r's queries are rows qsl[r]:qsl[r + 1]
    block_tables: torch.Tensor,  # [requests, max_blocks] int32
    seq_lens: torch.Tensor,  # [requests] int32
    scale: float,
    causal: bool = True,
) -> torch.Tensor:  # [tokens, H, D]
    """Attention of short queries (a decode step's one per request, a verification's few, a DSpark draft block), each
    request's the last of its seq_lens positions: writes k and v at slot_mapping, then attends over each request's
    blocks, causally (up to each query's position) or not (every key of the request)."""
    n, h, d = q.shape
    hkv, bs = k.shape[1], key_cache.shape[1]
    if k.stride(0) != v.stride(0):  # k came out of a q/k norm, v is still a view of the GEMM's output
        k, v = k.contiguous(), v.contiguous()
    for t in (q, k, v):
        assert t.stride(2) == 1 and t.stride(1) == d and t.dtype == key_cache.dtype
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    qsl, tables, lens = query_start_loc.contiguous(), block_tables.contiguous(), seq_lens.contiguous()
    assert qsl.dtype == tables.dtype == lens.dtype == torch.int32 and slot_mapping.dtype == torch.int64
    assert lens.shape[0] + 1 == qsl.shape[0] == tables.shape[0] + 1
    out = torch.empty(n, h, d, dtype=q.dtype)
    _fn("paged_attention", q.dtype)(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slot_mapping.contiguous().data_ptr(),
        qsl.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        out.data_ptr(),
        lens.shape[0],
        h,
        hkv,
        d,
        bs,
        scale,
        int(causal),
        torch.get_num_threads(),
    )
    return out


def prefill_supported(q: torch.Tensor) -> bool:
    """Whether prefill_attention takes these queries: bf16, a head dim that is a multiple of 64 up to 256, and a CPU
    with AVX512-BF16 (the kernel's pair products)."""
    handle = lib() if q.dtype == torch.bfloat16 and supports(q) else None
    d = q.shape[-1]
    return handle is not None and d % 64 == 0 and d <= 256 and bool(handle.prefill_attention_available())


def prefill_attention(
    q: torch.Tensor,  # [n, H, D] bf16: a prompt chunk's queries, rows contiguous per head, any row stride
    key_cache: torch.Tensor,  # [blocks, block_size, Hkv, D] contiguous, the chunk's keys already written
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [>= blocks of the context] int32: the request's
    prefix: int,  # cached keys before the chunk: query j is position prefix + j
    scale: float,
) -> torch.Tensor:  # [n, H, D]
    """Causal attention of one request's prompt chunk over its paged cache (see prefill_attention_bf16 in cpu.c);
    only where prefill_supported(q)."""
    n, h, d = q.shape
    hkv, bs = key_cache.shape[2], key_cache.shape[1]
    assert q.stride(2) == 1 and q.stride(1) == d and q.dtype == key_cache.dtype == torch.bfloat16
    assert key_cache.is_contiguous() and value_cache.is_contiguous() and block_table.dtype == torch.int32
    assert block_table.shape[0] * bs >= prefix + n and h % hkv == 0
    assert d % 64 == 0 and d <= 256, f"head dim {d}: the kernel takes multiples of 64 up to 256 (prefill_supported)"
    table = block_table.contiguous()
    out = torch.empty(n, h, d, dtype=q.dtype)
    failed = lib().prefill_attention_bf16(  # type: ignore[union-attr]
        q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), table.data_ptr(), n, prefix, h,
        hkv, d, bs, scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"prefill attention: no memory for {prefix + n} keys' packed copies")
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a [n, m] tensor whose rows are contiguous -> [n] int64."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _fn("argmax", x.dtype)(x.data_ptr(), _rows(x), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def markov_block(
    base: torch.Tensor,  # [R, k, V] fp32
    h: torch.Tensor,  # [R, k, hidden]
    w1: torch.Tensor,  # [V, rank]: the Markov head's embedding
    w2t: torch.Tensor,  # [rank, V]
    anchors: torch.Tensor,  # [R] int64
    conf_weight: torch.Tensor | None,  # [hidden + rank]: the confidence head's projection, or None
    conf_bias: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A DSpark block's greedy drafts, left to right, with the Markov correction (each position from the previous draft,
    the anchor first) and the confidence logits: ([R, k] int64, [R, k] fp32 or None), in one call
    (markov_block in cpu.c). rank <= 256; every weight in h's dtype."""
    r, k, v = base.shape
    rank, hidden = w2t.shape[0], h.shape[2]
    assert base.dtype == torch.float32 and h.dtype == w1.dtype == w2t.dtype and rank <= 256
    assert h.dtype in (torch.float32, torch.bfloat16) and w1.shape == (v, rank) and w2t.shape[1] == v
    assert anchors.dtype == torch.int64 and bool(((anchors >= 0) & (anchors < v)).all()), "an anchor outside W1"
    base, h, w1, w2t, anchors = (t.contiguous() for t in (base, h, w1, w2t, anchors))
    cw = None
    if conf_weight is not None:
        assert conf_weight.dtype == h.dtype and conf_weight.numel() == hidden + rank
        cw = conf_weight.contiguous()
    tokens = torch.empty(r, k, dtype=torch.int64)
    conf = torch.empty(r, k, dtype=torch.float32) if cw is not None else None
    _fn("markov_block", h.dtype)(
        base.data_ptr(), h.data_ptr(), hidden, w1.data_ptr(), w2t.data_ptr(), 0 if cw is None else cw.data_ptr(),
        conf_bias, anchors.data_ptr(), r, k, rank, v, tokens.data_ptr(), 0 if conf is None else conf.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return tokens, conf


SMALL_LINEAR_ROWS = 8  # small_linear's rows per pass over the weight


def small_linear_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 weight [N, K] in small_linear's layout, or None where the kernel cannot take it (no AVX512-BF16, not
    bf16, N % 16 or K % 2): then use another GEMM."""
    handle = lib() if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" else None
    n, k = weight.shape
    if handle is None or not handle.small_linear_available() or n % 16 or k % 2:
        return None
    w = weight.detach().contiguous()
    packed = torch.empty(n * k // 2, dtype=torch.int32)
    handle.small_linear_pack(w.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
    return packed.view(n // 16, k // 2, 16)


def small_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 (rows contiguous, any row stride) through the weight small_linear_pack packed -> [M, N] fp32
    (not rounded to bf16). Reads the weight once per SMALL_LINEAR_ROWS rows: for a few rows through a large weight."""
    nb, kh, _ = packed.shape
    m, k = x.shape
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and k == 2 * kh
    out = torch.empty(m, nb * 16, dtype=torch.float32)
    fn = lib().small_linear_bf16  # type: ignore[union-attr]
    for r in range(0, m, SMALL_LINEAR_ROWS):
        rows = min(SMALL_LINEAR_ROWS, m - r)
        fn(
            x[r].data_ptr(),
            x.stride(0),
            rows,
            packed.data_ptr(),
            nb * 16,
            k,
            out[r].data_ptr(),
            torch.get_num_threads(),
        )
    return out
