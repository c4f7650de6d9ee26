"""Copy a drafter checkpoint with its floating-point weights in bf16 (how the SmolLM2 drafter ships: half the size),
in safetensors shards of at most MAX_SHARD bytes (the loader reads every *.safetensors of the directory; no file of
the repository is over 16 MiB). Usage: python benchmarks/drafter/export.py SRC_DIR DST_DIR"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MAX_SHARD = 12 * 1024 * 1024


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].to(torch.bfloat16) if tensors[name].is_floating_point() else tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    for old in dst.glob("*.safetensors"):
        old.unlink()
    for i, shard in enumerate(shards, 1):
        save_file(shard, str(dst / f"model-{i:05d}-of-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
    if src.resolve() != dst.resolve():
        shutil.copy(src / "config.json", dst / "config.json")


if __name__ == "__main__":
    main()
