"""Copy a drafter checkpoint for shipping: floating-point weights in bf16 (half the size), or with --int8 every large
2-D weight as int8 with per-row scales (a quarter; dspark/speculative/drafters/dspark/int8.py), in safetensors
shards of at most MAX_SHARD bytes (the loader reads every *.safetensors of the directory; no file of the repository
is over 16 MiB). Usage: python benchmarks/drafter/export.py SRC_DIR DST_DIR [--int8]"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.speculative.drafters.dspark import int8

MAX_SHARD = 12 * 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--int8", action="store_true", help="store large 2-D weights as int8 with per-row scales")
    args = parser.parse_args()
    src, dst = args.src, args.dst
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    # A source already stored as int8 is dequantized first, so an export is the same whichever way its source came.
    tensors = int8.dequantize_state(tensors)
    if args.int8:
        tensors = int8.quantize_state(tensors)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point() and not name.endswith(int8.SCALE_SUFFIX):
            t = t.to(torch.bfloat16)
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    for old in dst.glob("*.safetensors"):
        old.unlink()
    for i, shard in enumerate(shards, 1):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dst / name), metadata={"format": "pt"})
    if src.resolve() != dst.resolve():
        shutil.copy(src / "config.json", dst / "config.json")


if __name__ == "__main__":
    main()
