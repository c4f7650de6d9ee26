"""Why long prompts grow faster than their tokens on CPU: the default model's prefill FLOPs at 2,000 and 8,000 tokens
(GEMMs vs causal attention), and the rates torch's CPU flash attention, dspark's bf16 prompt-chunk kernel and a GEMM
reach on this machine.

Usage: python benchmarks/cpu_attention_rate.py OUT.json   (one process, torch's default threads; medians of 5 calls)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dspark.kernels import cpu as cpu_kernels

# SmolLM2-135M-Instruct: 30 layers, hidden 576, 9 query heads of 64 (3 kv heads), MLP 1536
LAYERS, HIDDEN, HEADS, HEAD_DIM, KV_HEADS, MLP = 30, 576, 9, 64, 3, 1536


def gemm_flops_per_token() -> float:
    per_layer = HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * MLP
    return 2.0 * LAYERS * per_layer


def attention_flops(n: int) -> float:
    """Causal: query p reads p + 1 keys; QK and PV, 2 FLOPs a multiply-add, every head, every layer."""
    return 4.0 * LAYERS * HEADS * HEAD_DIM * n * (n + 1) / 2


def median_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out: dict[str, object] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    for n in (2000, 8000):
        gemm, attn = gemm_flops_per_token() * n, attention_flops(n)
        out[f"prefill_{n}"] = {
            "gemm_gflop": gemm / 1e9,
            "attention_gflop": attn / 1e9,
            "attention_share": attn / (gemm + attn),
        }
    out["flop_ratio_8000_over_2000"] = (gemm_flops_per_token() * 8000 + attention_flops(8000)) / (
        gemm_flops_per_token() * 2000 + attention_flops(2000)
    )
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(1, HEADS, 2048, HEAD_DIM).to(dtype)
        k, v = (torch.randn(1, HEADS, 6000, HEAD_DIM).to(dtype) for _ in range(2))
        ms = median_ms(lambda q=q, k=k, v=v: flash(q, k, v, scale=0.125))
        x, w = torch.randn(2048, HIDDEN).to(dtype), torch.randn(2 * MLP, HIDDEN).to(dtype)
        gemm_ms = median_ms(lambda x=x, w=w: F.linear(x, w))
        out[str(dtype).removeprefix("torch.")] = {
            "flash_2048x6000_gflops": 4 * HEADS * 2048 * 6000 * HEAD_DIM / ms / 1e6,
            "gemm_2048x576x3072_gflops": 2 * 2048 * HIDDEN * 2 * MLP / gemm_ms / 1e6,
        }
    # dspark's bf16 prompt-chunk kernel (kernels/cpu.py prefill_attention) on the same work: 2,048 queries after 3,952
    # cached keys (6,000 keys; causal within the chunk, so ~17% fewer FLOPs than the flash call above, counted exactly)
    with torch.inference_mode():
        q = torch.randn(2048, HEADS, HEAD_DIM).bfloat16()
        if cpu_kernels.prefill_supported(q):
            blocks, prefix = 6000 // 16, 6000 - 2048
            kc, vc = (torch.randn(blocks, 16, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(2))
            table = torch.arange(blocks, dtype=torch.int32)
            ms = median_ms(lambda: cpu_kernels.prefill_attention(q, kc, vc, table, prefix, 0.125))
            flops = 4 * HEADS * HEAD_DIM * (2048 * prefix + 2048 * 2049 / 2)
            out["bfloat16"]["dspark_prefill_kernel_2048_after_3952_gflops"] = flops / ms / 1e6  # type: ignore[index]
    text = json.dumps(out, indent=1)
    print(text)
    with open(sys.argv[1], "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
