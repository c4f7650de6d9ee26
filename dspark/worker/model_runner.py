"""Turns a SchedulerOutput into tensors, runs the target, samples. Owns the device, the KV cache and the model.

It never makes policy: which requests run and how many tokens each gets was decided by the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.config import EngineConfig
from dspark.engine.request import Request
from dspark.engine.scheduler import SchedulerOutput
from dspark.models.config import ModelConfig
from dspark.models.llama import CausalLM
from dspark.worker.attention.base import AttentionContext, AttentionMetadata, KVCache
from dspark.worker.attention.torch_ref import TorchAttention
from dspark.worker.numerics import padded_rows
from dspark.worker.sampler import SampledRow, Sampler, SamplingRow


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledRow]  # request id -> its new token, for requests that emitted one


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model: CausalLM, device: torch.device, dtype: torch.dtype, num_blocks: int
    ) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        cfg = model.config
        self.block_size = config.block_size
        shape = (num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim)
        # NOTE: zero-initialised, not empty: padded tiles read (and mask) block 0, and 0 * NaN would poison them.
        self.kv_caches = [
            KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        self.backend = TorchAttention()
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logit_rows: list[int] = []
        sampling_ids: list[str] = []
        bs = self.block_size
        for s in sched.scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            input_ids += req.all_token_ids[start:end]
            positions += range(start, end)
            slots += [req.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(query_start[-1] + s.num_new_tokens)
            seq_lens.append(end)
            tables.append(req.block_ids)
            if s.samples:
                logit_rows.append(query_start[-1] - 1)
                sampling_ids.append(req.request_id)

        num_actual = len(input_ids)
        pad = padded_rows(num_actual) - num_actual  # padding rows: token 0, position 0, slot -1
        dev = self.device
        max_blocks = max(len(t) for t in tables)
        meta = AttentionMetadata(
            num_actual_tokens=num_actual,
            slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=dev),
            query_start_loc_cpu=query_start,
            seq_lens_cpu=seq_lens,
            max_query_len=max(s.num_new_tokens for s in sched.scheduled),
            max_seq_len=max(seq_lens),
        )
        mcfg = self.model.config
        self.backend.prepare(meta, mcfg.num_kv_heads, mcfg.num_heads, bs)
        ids = torch.tensor(input_ids + [0] * pad, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions + [0] * pad, dtype=torch.int64, device=dev)
        hidden = self.model(ids, pos, AttentionContext(self.backend, meta, self.kv_caches))
        if not logit_rows:
            return RunnerOutput({})
        rows = logit_rows + [logit_rows[-1]] * (padded_rows(len(logit_rows)) - len(logit_rows))
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)])
        sampled = self.sampler(logits, [sampling_row(s.request) for s in sched.scheduled if s.samples])
        return RunnerOutput(dict(zip(sampling_ids, sampled, strict=True)))


def sampling_row(req: Request) -> SamplingRow:
    p = req.sampling_params
    banned: tuple[int, ...] = ()
    if req.num_output_tokens < p.min_tokens:
        eos = () if p.ignore_eos or req.eos_token_id is None else (req.eos_token_id,)
        banned = (*eos, *p.stop_token_ids)
    return SamplingRow(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        seed=req.seed,
        counter=req.num_output_tokens,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=req.output_token_ids,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        banned_token_ids=banned,
        num_logprobs=p.logprobs,
    )
