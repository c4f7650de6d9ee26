"""What the shipped drafter would weigh grown by 1-3 layers (train/grow.py) and exported as int8 (export.py --int8):
parameters and MiB on disk, against the repository's 24 MB for a drafter.

    python benchmarks/drafter/grown_sizes.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dspark.models.loader import load_config
from dspark.models.registry import DEFAULT_MODEL, resolve_model, shipped_drafter
from dspark.speculative.drafters.dspark.checkpoint import load_drafter, save_drafter
from dspark.train.grow import grow


def main() -> None:
    source = shipped_drafter(DEFAULT_MODEL)
    assert source is not None
    model = load_drafter(source, load_config(resolve_model(DEFAULT_MODEL)), torch.float32, torch.device("cpu"))
    export = Path(__file__).with_name("export.py")
    for extra in (1, 2, 3):
        grown = grow(model, extra)
        with tempfile.TemporaryDirectory() as tmp:
            save_drafter(grown, Path(tmp) / "fp32")
            subprocess.run([sys.executable, str(export), f"{tmp}/fp32", f"{tmp}/int8", "--int8"], check=True)
            size = sum(f.stat().st_size for f in (Path(tmp) / "int8").glob("*.safetensors"))
        params = sum(p.numel() for p in grown.parameters()) / 1e6
        print(f"{grown.config.num_layers} layers: {params:.1f} M parameters, {size / 2**20:.1f} MiB as int8")


if __name__ == "__main__":
    main()
