"""Offline throughput: dspark against Hugging Face transformers `generate`, same weights, same prompts, same run.

Both arms decode the same prompt token ids greedily and produce exactly `output_len` tokens per prompt (EOS does not
stop them), so their output tokens per second compare like with like. dspark batches continuously with at most
`batch_size` sequences in flight; transformers runs static batches of `batch_size` left-padded prompts. The
transformers model is built from dspark's ModelConfig and loaded with dspark's own state dict, so both arms multiply
exactly the same weights (a GGUF's dequantised ones included) in the same dtype.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dspark.bench.prompts import BUILTIN_PROMPTS
from dspark.config import EngineConfig, SamplingParams
from dspark.engine.llm_engine import LLMEngine
from dspark.errors import ConfigError
from dspark.llm import LLM
from dspark.models.llama import CausalLM
from dspark.outputs import RequestOutput
from dspark.utils.jsonl import read_jsonl_prompts

WARMUP_TEXT = "The quick brown fox jumps over the lazy dog."
WARMUP_TOKENS = 4

# dspark family -> (transformers config class, model class). All three take the same shape arguments.
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


@dataclass
class ArmResult:
    elapsed_s: float
    num_requests: int
    output_tokens: int
    outputs: list[list[int]]  # generated token ids per prompt, in prompt order (not written to JSON)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed_s

    def to_json(self) -> dict[str, Any]:
        return {
            "elapsed_s": self.elapsed_s,
            "num_requests": self.num_requests,
            "output_tokens": self.output_tokens,
            "output_throughput": self.output_throughput,
        }


def load_prompts(dataset_path: str | None, num_prompts: int) -> list[str]:
    """The first num_prompts prompts of the set, in its order; the set repeats if it is shorter."""
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ConfigError("num_prompts", num_prompts, "must be a positive integer")
    prompts = BUILTIN_PROMPTS if dataset_path is None else read_jsonl_prompts(Path(dataset_path))
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def tokenize(llm: LLM, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids once, for both arms: each prompt as one user turn through the chat template, or as plain text."""
    if chat:
        return [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    return [llm.tokenizer.encode(p, add_special_tokens=True) for p in prompts]


def run_dspark(engine: LLMEngine, prompt_ids: list[list[int]], output_len: int) -> ArmResult:
    """All prompts at once; the scheduler keeps at most max_num_seqs of them in flight."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind="final_only")
    warm = engine.tokenizer.encode(WARMUP_TEXT)
    engine.add_request(warm, dataclasses.replace(params, max_tokens=WARMUP_TOKENS))
    drain(engine)

    bar = tqdm(total=len(prompt_ids) * output_len, desc="dspark", unit="tok", file=sys.stderr)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompt_ids]
    final = drain(engine, bar)
    elapsed = time.perf_counter() - start
    bar.close()
    outputs = [final[i].outputs[0].token_ids for i in ids]
    return ArmResult(elapsed, len(ids), sum(len(o) for o in outputs), outputs)


def drain(engine: LLMEngine, bar: tqdm | None = None) -> dict[str, RequestOutput]:
    """Step until every request has finished; their final outputs by request id."""
    final = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        for out in outs:
            if out.finished:
                final[out.request_id] = out
        if bar is not None:
            bar.update(sum(len(out.new_token_ids) for out in outs))
    return final


def build_hf_model(model: CausalLM, device: torch.device, dtype: torch.dtype) -> Any:
    """A transformers model of the same family and shape as `model`, holding exactly its weights."""
    import transformers

    cfg = model.config
    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[cfg.family])
    kwargs: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }
    if cfg.family != "qwen2":  # Qwen2 always has q/k/v biases; the others take the flag
        kwargs["attention_bias"] = cfg.attention_bias
    hf = model_cls(config_cls(**kwargs)).to(device=device, dtype=dtype).eval()
    # Names are Hugging Face's on both sides; strict, so a renamed or missing tensor fails loudly here.
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


@torch.inference_mode()
def run_hf(hf: Any, prompt_ids: list[list[int]], output_len: int, batch_size: int, pad_token_id: int) -> ArmResult:
    """Static batches of batch_size prompts, left-padded, greedy, exactly output_len new tokens each."""
    import transformers

    device = next(hf.parameters()).device

    def generate(batch: list[list[int]], num_tokens: int) -> torch.Tensor:
        # No eos_token_id, so EOS is an ordinary token as with dspark's ignore_eos: greedy outputs stay
        # comparable token for token (min_new_tokens would otherwise mask EOS and change the argmax where the model
        # wants to stop).
        config = transformers.GenerationConfig(
            do_sample=False,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            pad_token_id=pad_token_id,
            eos_token_id=None,
        )
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        return out[:, width:].cpu()

    generate([prompt_ids[0][:8]], WARMUP_TOKENS)

    bar = tqdm(total=len(prompt_ids) * output_len, desc="hf", unit="tok", file=sys.stderr)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompt_ids), batch_size):
        new = generate(prompt_ids[i : i + batch_size], output_len)
        outputs += new.tolist()
        bar.update(new.numel())
    elapsed = time.perf_counter() - start
    bar.close()
    return ArmResult(elapsed, len(prompt_ids), sum(len(o) for o in outputs), outputs)


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How far the two arms' greedy outputs agree: a check that they computed the same thing, not a speed figure."""

    def common_prefix(x: list[int], y: list[int]) -> int:
        return next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))

    prefixes = [common_prefix(x, y) for x, y in zip(a, b, strict=True)]
    return {
        "identical_outputs": sum(x == y for x, y in zip(a, b, strict=True)),
        "num_outputs": len(a),
        "mean_common_prefix_tokens": sum(prefixes) / len(prefixes),
    }


def machine_info(device: torch.device) -> dict[str, Any]:
    import transformers

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = _cpu_name() or platform.processor() or platform.machine()
    return {
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": name,
        # Other processes on the machine skew CPU figures: record how busy it was when the run ended.
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def run_throughput(
    config: EngineConfig,
    *,
    num_prompts: int,
    output_len: int,
    dataset_path: str | None = None,
    chat: bool = True,
    hf: bool = True,
    repeats: int = 1,
    command: str = "",
) -> dict[str, Any]:
    """Run both arms (or dspark alone) and return the result dict that `--output-json` writes.

    With repeats > 1 the arms alternate round by round (so a noisy neighbour hits both alike); each arm reports its
    median round, and the ratio is the median of the per-round ratios.
    """
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise ConfigError("output_len", output_len, "must be a positive integer")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError("repeats", repeats, "must be a positive integer")
    prompts = load_prompts(dataset_path, num_prompts)
    batch_size = config.max_num_seqs
    llm = LLM(**dataclasses.asdict(config))
    engine = llm.engine
    prompt_ids = tokenize(llm, prompts, chat)
    longest = max(len(p) for p in prompt_ids)
    if longest + output_len > engine.max_model_len:
        raise ConfigError(
            "output_len",
            output_len,
            f"the longest prompt ({longest} tokens) plus output_len must fit max_model_len={engine.max_model_len}",
        )

    hf_model = build_hf_model(engine.model, engine.device, engine.dtype) if hf else None
    pad = engine.tokenizer.pad_token_id
    pad = engine.eos_token_id if pad is None else pad
    ds_runs: list[ArmResult] = []
    hf_runs: list[ArmResult] = []
    for _ in range(repeats):
        engine.kv.reset_prefix_cache()  # every round starts cold, as the first did
        ds_runs.append(run_dspark(engine, prompt_ids, output_len))
        if hf_model is not None:
            hf_runs.append(run_hf(hf_model, prompt_ids, output_len, batch_size, pad))
    dspark_arm = _median_run(ds_runs)
    hf_arm = _median_run(hf_runs) if hf_runs else None
    ratio = (
        statistics.median(d.output_throughput / h.output_throughput for d, h in zip(ds_runs, hf_runs, strict=True))
        if hf_runs
        else None
    )

    return {
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(engine.device),
        "config": {
            "model": config.model,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "dataset": dataset_path or "builtin",
            "num_prompts": num_prompts,
            "num_unique_prompts": len(set(prompts)),
            "output_len": output_len,
            "batch_size": batch_size,
            "chat": chat,
            "enable_prefix_caching": config.enable_prefix_caching,
            "total_input_tokens": sum(len(p) for p in prompt_ids),
        },
        "repeats": repeats,
        "dspark": {
            **dspark_arm.to_json(),
            "rounds_output_throughput": [r.output_throughput for r in ds_runs],
            "engine_metrics": engine.get_metrics(),
        },
        "hf": {**hf_arm.to_json(), "rounds_output_throughput": [r.output_throughput for r in hf_runs]}
        if hf_arm
        else None,
        "ratio": ratio,
        "greedy_agreement": greedy_agreement(dspark_arm.outputs, hf_arm.outputs) if hf_arm else None,
    }


def _median_run(runs: list[ArmResult]) -> ArmResult:
    return sorted(runs, key=lambda r: r.output_throughput)[(len(runs) - 1) // 2]


def summary_line(result: dict[str, Any]) -> str:
    cfg, ds, hf = result["config"], result["dspark"], result["hf"]
    line = f"dspark {ds['output_throughput']:.1f} tok/s"
    if hf is not None:
        line += f" | hf {hf['output_throughput']:.1f} tok/s | ratio {result['ratio']:.2f}x"
    return (
        f"{line} ({cfg['num_prompts']} prompts x {cfg['output_len']} tokens, batch {cfg['batch_size']}, "
        f"{cfg['dtype']}, {result['machine']['device']})"
    )
