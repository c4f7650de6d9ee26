"""Time the Triton paged-attention backend against the copy-bandwidth roofline and the torch reference, in one run.

Decode (q_len 1) and verification (q_len 8) at batch sizes 1..1024 and contexts 256..4096, with SmolLM2-135M's
attention shape (9 heads, 3 kv heads, head_dim 64, bf16, block_size 16). Per point:

- triton: one layer's forward (KV write + attention + split combine), replayed from a CUDA graph (as the engine runs
  it), L2 flushed before each sample (a real step's 30 layers read 30 different caches), median of --iters samples
  timed with CUDA events;
- bytes: the keys and values read (every request's whole context), q read, the output written, and the new keys and
  values read and written; GB/s and its fraction of the device-to-device copy bandwidth measured at the start
  (bytes read + written / time of a large tensor copy);
- torch: the reference backend's forward, eager (it is not meant for graphs), same flush and median.

    python benchmarks/gpu/bench_attention.py --output benchmarks/results/gpu-attention-h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from tqdm import tqdm

from dspark.attention.base import AttentionMetadata, KVCache
from dspark.attention.torch_ref import TorchAttention
from dspark.attention.triton_backend import TritonAttention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DTYPE = torch.bfloat16
FLUSH_BYTES = 256 << 20  # > 4x the H200's 60 MB L2


def time_gpu(fn: Callable[[], object], iters: int, flush: torch.Tensor) -> float:
    """Median seconds of fn() over iters samples, each after an L2 flush, timed by CUDA events around fn alone."""
    samples = []
    for _ in range(iters):
        flush.zero_()  # also gives the host time to enqueue fn before the GPU reaches the start event
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def copy_bandwidth(iters: int) -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(samples)


def make_step(batch: int, q_len: int, context: int) -> tuple[AttentionMetadata, KVCache, tuple[torch.Tensor, ...]]:
    """batch requests of `context` keys after the step, the last q_len of them new; scattered blocks."""
    dev = torch.device("cuda")
    blocks_per_req = triton.cdiv(context, BLOCK_SIZE)
    num_blocks = batch * blocks_per_req + 1
    tables = (torch.randperm(num_blocks - 1, device=dev)[: batch * blocks_per_req] + 1).view(batch, blocks_per_req)
    tables = tables.to(torch.int32)
    pos = torch.arange(context - q_len, context, device=dev)
    slots = (tables[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).flatten()
    num_tokens = batch * q_len
    starts = list(range(0, num_tokens + 1, q_len))
    meta = AttentionMetadata(
        num_actual_tokens=num_tokens,
        slot_mapping=slots,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=dev),
        block_tables=tables,
        query_start_loc_cpu=starts,
        seq_lens_cpu=[context] * batch,
        max_query_len=q_len,
        max_seq_len=context,
    )
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache = KVCache(torch.randn(shape, device=dev).to(DTYPE), torch.randn(shape, device=dev).to(DTYPE))
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, device=dev).to(DTYPE)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=dev).to(DTYPE)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=dev).to(DTYPE)
    return meta, cache, (q, k, v)


def bytes_moved(batch: int, q_len: int, context: int) -> int:
    size = DTYPE.itemsize
    kv_read = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * size
    q_and_out = 2 * batch * q_len * NUM_HEADS * HEAD_DIM * size
    kv_write = 2 * 2 * batch * q_len * NUM_KV_HEADS * HEAD_DIM * size  # new keys and values, read then written
    return kv_read + q_and_out + kv_write


def bench_point(batch: int, q_len: int, context: int, iters: int, ref_iters: int, flush: torch.Tensor) -> dict:
    meta, cache, (q, k, v) = make_step(batch, q_len, context)
    scale = HEAD_DIM**-0.5
    backend = TritonAttention()
    backend.prepare(meta, NUM_KV_HEADS, NUM_HEADS, BLOCK_SIZE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, cache, meta, scale)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            backend.forward(q, k, v, cache, meta, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    triton_s = time_gpu(graph.replay, iters, flush)

    ref = TorchAttention()
    ref.prepare(meta, NUM_KV_HEADS, NUM_HEADS, BLOCK_SIZE)
    ref.forward(q, k, v, cache, meta, scale)
    torch_s = time_gpu(lambda: ref.forward(q, k, v, cache, meta, scale), ref_iters, flush)
    moved = bytes_moved(batch, q_len, context)
    return {
        "q_len": q_len,
        "batch": batch,
        "context": context,
        "num_splits": backend.num_splits,
        "triton_us": triton_s * 1e6,
        "bytes": moved,
        "triton_gb_s": moved / triton_s / 1e9,
        "torch_us": torch_s * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("bench_attention.json"))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--ref-iters", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--q-lens", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"

    began = time.perf_counter()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(args.iters)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    points = [(q, b, c) for q in args.q_lens for b in args.batches for c in args.contexts]
    rows = []
    for q_len, batch, context in tqdm(points, desc="attention"):
        row = bench_point(batch, q_len, context, args.iters, args.ref_iters, flush)
        row["roofline_frac"] = row["triton_gb_s"] * 1e9 / copy_bw
        row["speedup_vs_torch"] = row["torch_us"] / row["triton_us"]
        rows.append(row)
        torch.cuda.empty_cache()

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host": platform.node(),
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE},
        "dtype": str(DTYPE),
        "copy_bandwidth_gb_s": copy_bw / 1e9,
        "timing": "triton: CUDA-graph replay of one layer's forward; torch: eager; L2 flushed; median of CUDA events",
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")

    print(f"\n{result['device']}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)\n")
    print("| q_len | batch | context | splits | triton us | GB/s | of roofline | torch us | speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['q_len']} | {r['batch']} | {r['context']} | {r['num_splits']} | {r['triton_us']:.1f} "
            f"| {r['triton_gb_s']:.0f} | {r['roofline_frac']:.0%} | {r['torch_us']:.0f} "
            f"| {r['speedup_vs_torch']:.1f}x |"
        )
    best = max(rows, key=lambda r: r["roofline_frac"])
    print(
        f"\n{len(rows)} points in {time.perf_counter() - began:.0f} s; best {best['roofline_frac']:.0%} of the copy "
        f"roofline (q_len {best['q_len']}, batch {best['batch']}, context {best['context']}); JSON: {args.output}"
    )


if __name__ == "__main__":
    main()
