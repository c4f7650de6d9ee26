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


def run_dspark(
    engine: LLMEngine, prompt_ids: list[list[int]], output_len: int, concurrency: int | None = None
) -> ArmResult:
    """The prompts with at most `concurrency` of them in flight (None: all added at once, the scheduler keeping
    max_num_seqs in flight)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind="final_only")
    warm = engine.tokenizer.encode(WARMUP_TEXT)
    engine.add_request(warm, dataclasses.replace(params, max_tokens=WARMUP_TOKENS))
    drain(engine)

    bar = tqdm(total=len(prompt_ids) * output_len, desc="dspark", unit="tok", file=sys.stderr)
    limit = len(prompt_ids) if concurrency is None else concurrency
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompt_ids[:limit]]
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            bar.update(len(out.new_token_ids))
            if out.finished:
                final[out.request_id] = out
                if len(ids) < len(prompt_ids):
                    ids.append(engine.add_request(prompt_ids[len(ids)], params))
    elapsed = time.perf_counter() - start
    bar.close()
    outputs = [final[i].outputs[0].token_ids for i in ids]
    return ArmResult(elapsed, len(ids), sum(len(o) for o in outputs), outputs)


def dspark_ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from adding a prompt to its first token (its whole prefill, in max_num_batched_tokens chunks)."""
    engine.kv.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, output_kind="final_only")
    start = time.perf_counter()
    engine.add_request(prompt, params)
    drain(engine)
    return time.perf_counter() - start


def hf_forward(hf: Any, prompt: list[int]) -> float:
    """Seconds of transformers' forward over the prompt, the last position's logits only (what a first token needs)."""
    device = next(hf.parameters()).device
    ids = torch.tensor([prompt], device=device)
    start = time.perf_counter()
    with torch.inference_mode():
        hf(ids, logits_to_keep=1)
    return time.perf_counter() - start


def long_prompt(length: int, seed: int = 0) -> list[int]:
    """A prompt of `length` token ids, the same for both arms (random ids: the forward's cost does not read them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (length,), generator=g).tolist()


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
    batch_sizes: list[int] | None = None,
    prefill_lens: list[int] | None = None,
    dataset_path: str | None = None,
    chat: bool = True,
    hf: bool = True,
    repeats: int = 1,
    command: str = "",
) -> dict[str, Any]:
    """Run both arms (or dspark alone) and return the result dict that `--output-json` writes.

    Decode: for each batch size B (default: the engine's max_num_seqs), the prompts with at most B in flight in
    dspark and in static batches of B in transformers; output tokens/s. Prefill: for each prompt length N, dspark's
    time to the first token of one N-token prompt against transformers' forward over it. With repeats > 1 the arms
    alternate round by round (so a noisy neighbour hits both alike); each arm reports its median round, and the ratio
    is the median of the per-round ratios. The top-level dspark / hf / ratio are the first batch size's.
    """
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise ConfigError("output_len", output_len, "must be a positive integer")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError("repeats", repeats, "must be a positive integer")
    batch_sizes = batch_sizes or [config.max_num_seqs]
    for b in batch_sizes:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ConfigError("batch_size", b, "must be a positive integer")
    prompts = load_prompts(dataset_path, num_prompts)
    llm = LLM(**dataclasses.asdict(dataclasses.replace(config, max_num_seqs=max(batch_sizes))))
    engine = llm.engine
    prompt_ids = tokenize(llm, prompts, chat)
    longest = max(len(p) for p in prompt_ids)
    if longest + output_len > engine.max_model_len:
        raise ConfigError(
            "output_len",
            output_len,
            f"the longest prompt ({longest} tokens) plus output_len must fit max_model_len={engine.max_model_len}",
        )
    for n in prefill_lens or []:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < engine.max_model_len:
            raise ConfigError("prefill_len", n, f"an integer in [1, max_model_len - 1 = {engine.max_model_len - 1}]")

    hf_model = build_hf_model(engine.model, engine.device, engine.dtype) if hf else None
    pad = engine.tokenizer.pad_token_id
    pad = engine.eos_token_id if pad is None else pad
    ds_runs: dict[int, list[ArmResult]] = {b: [] for b in batch_sizes}
    hf_runs: dict[int, list[ArmResult]] = {b: [] for b in batch_sizes}
    ttft: dict[int, list[float]] = {n: [] for n in prefill_lens or []}
    forward: dict[int, list[float]] = {n: [] for n in prefill_lens or []}
    for _ in range(repeats):
        for b in batch_sizes:
            engine.kv.reset_prefix_cache()  # every round starts cold, as the first did
            ds_runs[b].append(run_dspark(engine, prompt_ids, output_len, b))
            if hf_model is not None:
                hf_runs[b].append(run_hf(hf_model, prompt_ids, output_len, b, pad))
        for n in prefill_lens or []:
            prompt = long_prompt(n)
            ttft[n].append(dspark_ttft(engine, prompt))
            if hf_model is not None:
                forward[n].append(hf_forward(hf_model, prompt))

    decode = []
    for b in batch_sizes:
        dspark_arm = _median_run(ds_runs[b])
        hf_arm = _median_run(hf_runs[b]) if hf_runs[b] else None
        ratio = (
            statistics.median(
                d.output_throughput / h.output_throughput for d, h in zip(ds_runs[b], hf_runs[b], strict=True)
            )
            if hf_runs[b]
            else None
        )
        decode.append(
            {
                "batch_size": b,
                "dspark": {
                    **dspark_arm.to_json(),
                    "rounds_output_throughput": [r.output_throughput for r in ds_runs[b]],
                },
                "hf": {**hf_arm.to_json(), "rounds_output_throughput": [r.output_throughput for r in hf_runs[b]]}
                if hf_arm
                else None,
                "ratio": ratio,
                "greedy_agreement": greedy_agreement(dspark_arm.outputs, hf_arm.outputs) if hf_arm else None,
            }
        )
    prefill = [
        {
            "prompt_len": n,
            "dspark_ttft_s": statistics.median(ttft[n]),
            "rounds_dspark_ttft_s": ttft[n],
            "hf_forward_s": statistics.median(forward[n]) if forward[n] else None,
            "rounds_hf_forward_s": forward[n],
            # the paired rounds' median of transformers' forward over dspark's first token: >= 1 means no slower
            "ratio": statistics.median(f / t for f, t in zip(forward[n], ttft[n], strict=True)) if forward[n] else None,
        }
        for n in prefill_lens or []
    ]
    first = decode[0]
    return {
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(engine.device),
        "config": {
            "model": config.model,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "batch_invariant": config.batch_invariant,
            "dataset": dataset_path or "builtin",
            "num_prompts": num_prompts,
            "num_unique_prompts": len(set(prompts)),
            "output_len": output_len,
            "batch_size": batch_sizes[0],
            "batch_sizes": batch_sizes,
            "prefill_lens": prefill_lens or [],
            "chat": chat,
            "enable_prefix_caching": config.enable_prefix_caching,
            "total_input_tokens": sum(len(p) for p in prompt_ids),
        },
        "repeats": repeats,
        "dspark": {**first["dspark"], "engine_metrics": engine.get_metrics()},
        "hf": first["hf"],
        "ratio": first["ratio"],
        "greedy_agreement": first["greedy_agreement"],
        "decode": decode,
        "prefill": prefill,
        # time to first token at the longest prompt over that at the shortest: what grows with the prompt
        "prefill_growth": prefill[-1]["dspark_ttft_s"] / prefill[0]["dspark_ttft_s"] if len(prefill) > 1 else None,
    }


def _median_run(runs: list[ArmResult]) -> ArmResult:
    return sorted(runs, key=lambda r: r.output_throughput)[(len(runs) - 1) // 2]


def summary_line(result: dict[str, Any]) -> str:
    cfg = result["config"]
    parts = []
    for row in result.get("decode") or [{"batch_size": cfg["batch_size"], **result}]:
        ds, hf = row["dspark"], row["hf"]
        part = f"batch {row['batch_size']}: dspark {ds['output_throughput']:.1f} tok/s"
        if hf is not None:
            part += f", hf {hf['output_throughput']:.1f}, {row['ratio']:.2f}x"
        parts.append(part)
    for row in result.get("prefill") or []:
        part = f"prefill {row['prompt_len']}: first token {row['dspark_ttft_s']:.2f} s"
        if row["hf_forward_s"] is not None:
            part += f", hf forward {row['hf_forward_s']:.2f} s, {row['ratio']:.2f}x"
        parts.append(part)
    if result.get("prefill_growth") is not None:
        parts.append(f"growth {result['prefill_growth']:.2f}x")
    return (
        f"{' | '.join(parts)} ({cfg['num_prompts']} prompts x {cfg['output_len']} tokens, {cfg['dtype']}, "
        f"{result['machine']['device']})"
    )
