"""DSpark drafter checkpoints: a directory with config.json and model.safetensors (DeepSpec's key names, no prefix).

Loading checks the drafter against its target first (vocabulary, hidden size, tapped layers), then every tensor's
shape and dtype before anything is allocated, and names the file and the problem on any mismatch. Only JSON and
safetensors are parsed. Weights may be stored as int8 with per-row scales (int8.py); they are dequantized at load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark.errors import ModelLoadError
from dspark.models.config import ModelConfig
from dspark.models.llama import Rotary
from dspark.speculative.drafters.dspark import int8
from dspark.speculative.drafters.dspark.config import DSparkConfig
from dspark.speculative.drafters.dspark.model import DSparkModel

WEIGHTS = "model.safetensors"
RANK_KEY = "markov_head.markov_w1.weight"
CONFIDENCE_KEY = "confidence_head.proj.weight"


def random_drafter(cfg: DSparkConfig, seed: int = 0) -> DSparkModel:
    """A randomly initialised drafter (fp32, CPU): for tests, and the starting point of training."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DSparkModel(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name == "mask_embedding":
                    p.normal_(0.0, 0.02)
                elif p.dim() == 2 and "markov" in name:
                    p.normal_(0.0, 0.02)  # start near a zero correction: the backbone alone drafts
    return model.eval()


def save_drafter(model: DSparkModel, directory: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    model.config.save(out)
    return out


def load_drafter(path: str | Path, target: ModelConfig, dtype: torch.dtype, device: torch.device) -> DSparkModel:
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: a DSpark drafter is a directory with config.json and {WEIGHTS}")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: cannot be read ({e})") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files (drafter weights are read only from safetensors)")
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}  # tensor name -> the file it came from, for the errors
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensors[name], origin[name] = f.get_tensor(name), file
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None
    try:
        tensors = int8.dequantize_state(tensors)
    except int8.ScaleError as e:
        raise ModelLoadError(f"{origin[e.name]}: {e}") from None
    rank = tensors[RANK_KEY].shape[1] if RANK_KEY in tensors and tensors[RANK_KEY].dim() == 2 else None
    # Configs that do not say (DFlash's) have a Markov head or a confidence head exactly when their tensors are there.
    cfg = DSparkConfig.from_json(
        raw, str(path / "config.json"), markov_rank=rank, confidence_head=CONFIDENCE_KEY in tensors
    )
    cfg.check_target(target, str(path))

    # Built on the meta device, the model allocates nothing until every tensor has been checked against it: a
    # config that implies sizes far beyond the file's fails on a shape, not in the allocator.
    with torch.device("meta"):
        model = DSparkModel(cfg)
    params = dict(model.named_parameters())
    unexpected = sorted(set(tensors) - set(params))
    if unexpected:
        raise ModelLoadError(
            f"{origin[unexpected[0]]}: unexpected tensors {', '.join(unexpected[:5])} for this drafter config"
        )
    missing = sorted(set(params) - set(tensors))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{path}: missing tensors {shown}")
    for name, p in params.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ModelLoadError(
                f"{origin[name]}: tensor {name!r} has shape {tuple(t.shape)}, the config implies {tuple(p.shape)}"
            )
        if not t.is_floating_point():
            raise ModelLoadError(f"{origin[name]}: tensor {name!r} has dtype {t.dtype}; weights are floating point")
    model.load_state_dict({k: t.to(device=device, dtype=dtype) for k, t in tensors.items()}, assign=True)
    # NOTE: RoPE tables stay fp32 whatever the weights' dtype (as the target's), and cover every position the target
    # can reach plus a block, whatever the drafter's own config says (a damaged one could ask for any size).
    positions = target.max_position_embeddings + cfg.block_size
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, positions).to(device)
    return model.eval()
