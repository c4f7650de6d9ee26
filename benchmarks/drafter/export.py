"""Copy a drafter checkpoint with its floating-point weights in bf16: how the SmolLM2 drafter ships (half the size)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    cast = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in tensors.items()}
    save_file(cast, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")


if __name__ == "__main__":
    main()
