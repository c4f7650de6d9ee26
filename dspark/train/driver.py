"""`dspark train-drafter`: data, training loop, checkpoints and resume for a DSpark drafter of a target.

The run directory holds everything, so a run may span several machines or GPU sessions:
- sequences.npz or sequences.jsonl: the target's regenerated answers (made once, as JSON lines, when neither is there;
  a resumed run reuses them; benchmarks/drafter/gen_data.py makes them at scale);
- drafter/: the latest drafter checkpoint (config.json + model.safetensors, what the engine loads);
- state.safetensors + state.json: the optimiser's moments and the step counters. Only safetensors and JSON are
  written or read (no pickle).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dspark.errors import ConfigError
from dspark.llm import LLM
from dspark.speculative.drafters.dspark.checkpoint import load_drafter, random_drafter, save_drafter
from dspark.speculative.drafters.dspark.config import DSparkConfig
from dspark.train.data import Sequence, load_sequences, prompt_pool, regenerate, save_sequences, sequences_file
from dspark.train.grow import grow
from dspark.train.trainer import batch_loss, make_optimizer, optimiser_step, pad_batch


@dataclass
class TrainConfig:
    data_dir: str
    output_dir: str
    num_layers: int = 2
    block_size: int = 7
    markov_rank: int = 32
    steps: int = 2000
    lr: float = 6e-4
    blocks_per_sequence: int = 16
    batch_size: int = 8  # sequences per optimiser step
    prompts_per_source: int = 500
    samples_per_prompt: int = 1
    max_tokens: int = 256
    temperature: float = 1.0
    checkpoint_every: int = 200
    seed: int = 0
    time_limit: float | None = None  # seconds of the training loop (answering the pool comes first, untimed): stop
    # early, checkpointed, and resume later with the same settings
    init_from: str | None = None  # a drafter to fine-tune (the shipped one, say) when the run has no checkpoint yet
    grow_layers: int = 0  # identity layers added on top of init_from's (train/grow.py)


def _save_state(run: Path, optimizer: torch.optim.Optimizer, scheduler: Any, step: int, model: torch.nn.Module) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    steps: dict[str, float] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if st:
                name = names[id(p)]
                tensors[f"{name}.exp_avg"] = st["exp_avg"].detach().cpu().contiguous()
                tensors[f"{name}.exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().contiguous()
                steps[name] = float(st["step"])
    save_file(tensors, str(run / "state.safetensors"))
    (run / "state.json").write_text(json.dumps({"step": step, "param_steps": steps, "scheduler": scheduler.last_epoch}))


def _load_state(run: Path, optimizer: torch.optim.Optimizer, scheduler: Any, model: torch.nn.Module) -> int:
    """Restore the optimiser's moments and the schedule's position; returns the step to continue from."""
    meta = json.loads((run / "state.json").read_text())
    tensors = load_file(str(run / "state.safetensors"))
    params = dict(model.named_parameters())
    for name, step in meta["param_steps"].items():
        p = params[name]
        optimizer.state[p] = {
            "step": torch.tensor(step),
            "exp_avg": tensors[f"{name}.exp_avg"].to(p.device, p.dtype),
            "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].to(p.device, p.dtype),
        }
    scheduler.last_epoch = int(meta["scheduler"])
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    return int(meta["step"])


def check_grow(cfg: TrainConfig) -> None:
    if cfg.grow_layers < 0 or (cfg.grow_layers and cfg.init_from is None):
        raise ConfigError("grow_layers", cfg.grow_layers, "0, or layers to add to the init_from drafter (>= 1)")


def train_drafter(cfg: TrainConfig, llm: LLM, progress: bool = True) -> dict[str, Any]:
    """Train (or resume) a drafter for llm's model; returns a summary (steps, losses, acceptance, time)."""
    check_grow(cfg)
    run = Path(cfg.output_dir)
    run.mkdir(parents=True, exist_ok=True)
    target = llm.engine.model
    for p in target.parameters():
        p.requires_grad_(False)
    device, dtype = llm.engine.device, llm.engine.dtype

    seq_path = sequences_file(run)
    if seq_path is not None:
        sequences = load_sequences(seq_path)
    else:
        pool = prompt_pool(Path(cfg.data_dir), cfg.prompts_per_source, cfg.seed)
        sequences = regenerate(
            llm, pool, cfg.samples_per_prompt, cfg.max_tokens, cfg.temperature, cfg.seed, progress=progress
        )
        save_sequences(run / "sequences.jsonl", sequences)
    if not sequences:
        raise ConfigError("data_dir", cfg.data_dir, "gave no training sequence")

    drafter_dir = run / "drafter"
    if (drafter_dir / "config.json").exists():
        model = load_drafter(drafter_dir, target.config, torch.float32, device)
    elif cfg.init_from is not None:
        model = load_drafter(cfg.init_from, target.config, torch.float32, device)
        # Its shape wins over the shape flags. Its confidence calibration does not carry over: training moves the
        # confidences it was fitted to (calibrate-drafter fits a new one).
        model.config = dataclasses.replace(
            model.config, sts_temperatures=None, sts_biases=None, sts_by_temperature=None
        )
        if cfg.grow_layers:
            model = grow(model, cfg.grow_layers, cfg.seed)
    else:
        dcfg = DSparkConfig.for_target(
            target.config, num_layers=cfg.num_layers, block_size=cfg.block_size, markov_rank=cfg.markov_rank
        )
        model = random_drafter(dcfg, seed=cfg.seed).to(device)
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    optimizer, scheduler = make_optimizer(model, cfg.steps, cfg.lr)
    start = _load_state(run, optimizer, scheduler, model) if (run / "state.json").exists() else 0
    (run / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")

    rng = random.Random(cfg.seed + start)
    g = torch.Generator().manual_seed(cfg.seed + start)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not progress, desc="train-drafter")
    batches = _batches(sequences, cfg.batch_size, rng)
    running_loss = running_acc = None
    history = []
    began = time.monotonic()
    for step in bar:
        batch = next(batches)
        tokens, mask = pad_batch([(seq.tokens, seq.num_prompt_tokens) for seq in batch], device)
        with autocast:
            losses = batch_loss(model, target, tokens, mask, cfg.blocks_per_sequence, g)
        if losses is not None:  # None: no sequence of the batch had a valid anchor (too short an answer)
            optimiser_step(model, optimizer, scheduler, losses.total)
            loss = float(losses.total.detach())
            running_loss = loss if running_loss is None else 0.98 * running_loss + 0.02 * loss
            running_acc = losses.acceptance if running_acc is None else 0.98 * running_acc + 0.02 * losses.acceptance
            bar.set_postfix(loss=f"{running_loss:.3f}", accept=f"{running_acc:.3f}")
        out_of_time = cfg.time_limit is not None and time.monotonic() - began > cfg.time_limit
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps or out_of_time:
            save_drafter(model, drafter_dir)
            _save_state(run, optimizer, scheduler, step + 1, model)
            history.append({"step": step + 1, "loss": running_loss, "acceptance": running_acc})
        if out_of_time:
            break
    bar.close()
    done = history[-1]["step"] if history else start
    return {
        "steps": cfg.steps,
        "steps_done": done,
        "finished": done >= cfg.steps,
        "sequences": len(sequences),
        "seconds": round(time.monotonic() - began, 1),
        "history": history,
    }


def _batches(sequences: list[Sequence], size: int, rng: random.Random) -> Iterator[list[Sequence]]:
    """Endless batches, every sequence once per epoch: shuffled, then grouped with sequences of similar length (less
    padding) in windows of 16 batches, the batches themselves shuffled. A resumed run starts a fresh epoch (its order
    is seeded by the step it resumes from)."""
    while True:
        order = list(sequences)
        rng.shuffle(order)
        window = size * 16
        batches = []
        for w in range(0, len(order), window):
            chunk = sorted(order[w : w + window], key=lambda q: len(q.tokens))
            batches += [chunk[i : i + size] for i in range(0, len(chunk), size)]
        rng.shuffle(batches)
        yield from batches
