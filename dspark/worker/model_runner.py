"""Turns a SchedulerOutput into tensors, runs the target, samples or verifies, and drives the drafter.

It never makes policy: which requests run, how many tokens and drafts each gets, and who drafts next was decided by
the scheduler and the engine.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.attention.base import AttentionBackend, AttentionContext, AttentionMetadata, KVCache, slots_for
from dspark.attention.sdpa import SdpaAttention
from dspark.attention.torch_ref import TorchAttention
from dspark.config import EngineConfig
from dspark.core.request import Request
from dspark.core.scheduler import ScheduledRequest, SchedulerOutput
from dspark.errors import ConfigError
from dspark.models.config import ModelConfig
from dspark.models.llama import CausalLM
from dspark.outputs import TokenLogprobs
from dspark.sample.ops import SamplingRow, logits_to_probs
from dspark.sample.rejection import VerifyRow, verify, verify_plain
from dspark.sample.sampler import SampledRow, Sampler
from dspark.speculative.budget import FlatLayout
from dspark.speculative.drafters.base import Drafter, Proposal
from dspark.speculative.drafters.dspark.drafter import DSparkDrafter
from dspark.utils.numerics import rows_for
from dspark.utils.platform import triton_available
from dspark.utils.transfer import Download, download, upload, upload_tensor
from dspark.worker.cuda_graphs import GraphRunner
from dspark.worker.spec_pipeline import PlainStart, SpecLaunch, SpecPipeline, SpecResult

logger = logging.getLogger("dspark")

LogitsOf = Callable[[list[int]], torch.Tensor]  # the step's fp32 logits of these flattened rows (padding allowed)


@dataclass
class RunnerOutput:
    # request id -> the tokens it emitted this step (accepted drafts, then one sampled, corrected or bonus token),
    # for requests that emitted any
    sampled: dict[str, list[SampledRow]]
    num_accepted: dict[str, int] = field(default_factory=dict)  # request id -> drafts accepted, if it verified any
    # A continued step's tokens instead of `sampled`: one per request, in the step's order, without logprobs (every
    # request of a continued step samples one plain token): a SampledRow and a dict entry per request would be a
    # large share of a continued step's host work.
    tokens: list[int] | None = None
    spec: SpecResult | None = None  # a pipelined speculative step's outputs, one row per request in the step's order
    # request id -> (index of the first prompt token covered, entries): SamplingParams.prompt_logprobs of prompt chunks
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass
class Launched:
    """A step whose device work is queued. Steps the host must see before it can go on (verification, logprobs)
    are computed already (output); a plain sampling step's tokens are still on their way to the host (tokens, on the
    device, feed the next step when it is launched before this one is collected: async scheduling)."""

    sched: SchedulerOutput
    output: RunnerOutput | None = None
    tokens: torch.Tensor | None = None  # [n] int64 on the device: the sampling requests' tokens, in order
    download: Download | None = None
    request_ids: list[str] = field(default_factory=list)  # the sampling requests, in the order of tokens
    # "greedy" or "temperature": the Request.sampling_path every sampling request has. A request's path never
    # changes, so a step continuing (some of) this one's requests takes the same path without asking each again.
    plain: str | None = None
    # plain == "temperature": the rows' temperatures ([n] fp32 on the device), seeds and output positions (int64), for
    # a step that continues the same entries (StepPolicy.next_step) to reuse, its positions one further on.
    temperature_rows: tuple[torch.Tensor, np.ndarray, np.ndarray] | None = None
    spec: SpecLaunch | None = None  # a pipelined speculative step (worker/spec_pipeline.py)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


PROMPT_LOGPROB_ROWS = 256  # prompt positions whose full-vocabulary logprobs are held at once (49k fp32 each: 48 MiB)
GRAPH_MAX_TOKENS = 8192  # steps past this run eagerly: their kernels are long enough that launches no longer matter


def make_backend(name: str, device: torch.device, invariant: bool = False) -> AttentionBackend:
    """The attention backend for this engine: Triton on CUDA when asked for or by default (auto); on CPU torch's fused
    SDPA (auto, sdpa), or the torch reference (torch, and auto in batch-invariant mode: its fixed tiles make a row
    independent of its batch). invariant: also the Triton backend's batch-invariant tiling."""
    if name == "triton" or (name == "auto" and device.type == "cuda" and triton_available()):
        if device.type != "cuda":
            raise ConfigError("attention_backend", name, "triton needs a CUDA device; use auto, sdpa or torch here")
        from dspark.attention.triton_backend import TritonAttention

        return TritonAttention(invariant=invariant)
    if name == "sdpa" or (name == "auto" and not invariant):
        return SdpaAttention()
    return TorchAttention()


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        drafter: Drafter | None = None,
        verify_method: str = "strict",
        max_model_len: int | None = None,
        num_spec_tokens: int = 0,
        ema_alpha: float = 0.0,
    ) -> None:
        """ema_alpha: pipelined speculative steps' confidence EMA (the spec's adaptive_verification_ema_alpha)."""
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
        self.backend = make_backend(config.attention_backend, device, config.batch_invariant)
        # Matmul rows padded for batch invariance (utils/numerics.py): on CUDA (its graphs' shapes) and on CPU in
        # batch-invariant mode.
        self.pad_rows = device.type == "cuda" or config.batch_invariant
        self.sampler = Sampler()
        self.drafter = drafter
        self.verify_method = verify_method
        # request id -> (a drafting pass's [R, k, vocab] distributions, the request's row in it): where the
        # distributions its pending drafts were drawn from are
        self._draft_probs: dict[str, tuple[torch.Tensor, int]] = {}
        # verify_plain where every request allows it (benchmarks/gpu/step_profile.py turns it off to time verify()'s
        # row-by-row path beside it)
        self.plain_verify = True
        # Benchmarks only (CUDA): each launch's device time, a pair of events around its work (None: not timed).
        self.device_steps: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        self.graphs: GraphRunner | None = None
        if device.type == "cuda" and not config.enforce_eager and self.backend.name == "triton":
            from dspark.attention.triton_backend import TritonAttention

            self.graphs = GraphRunner(
                model,
                self.kv_caches,
                functools.partial(TritonAttention, invariant=config.batch_invariant),
                config.max_num_seqs,
                min(config.max_num_batched_tokens, GRAPH_MAX_TOKENS),
                (1, num_spec_tokens + 1) if num_spec_tokens else (1,),
                max_model_len or cfg.max_position_embeddings,
                config.block_size,
                drafter.tap_layers if drafter is not None else (),
                device,
                getattr(drafter, "write_context_all", None),
            )
            self.graphs.capture()
            capture_drafter = getattr(drafter, "capture_graphs", None)
            if capture_drafter is not None and getattr(drafter, "backend", self.backend).name == "triton":
                capture_drafter(config.max_num_seqs, max_model_len or cfg.max_position_embeddings)
        # Pipelined speculative steps (drafting and verification on the device, launched a step ahead): a DSpark
        # drafter with a confidence head, whose drafts the device can allocate and verify alone.
        self.pipeline: SpecPipeline | None = None
        if isinstance(drafter, DSparkDrafter) and drafter.model.confidence_head is not None:
            self.pipeline = SpecPipeline(
                drafter,
                self._pipeline_forward,
                device,
                config.max_num_seqs,
                max_model_len or cfg.max_position_embeddings,
                config.block_size,
                cfg.vocab_size,
                verify_method,
                ema_alpha,
            )
            if self.graphs is not None and drafter.backend.name == "triton":
                from dspark.attention.triton_backend import TritonAttention

                try:
                    self.pipeline.capture(
                        self.graphs, functools.partial(TritonAttention, invariant=config.batch_invariant)
                    )
                except Exception:  # the engine still serves, drafting on the host's path: loudly, not silently
                    logger.exception("capturing pipelined speculative steps failed; drafting on the host instead")
                    self.pipeline = None
                    torch.cuda.synchronize(device)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, previous: Launched | None = None) -> Launched:
        """Queue the step on the device (_launch), timed on the device where device_steps asks for it."""
        start = self._device_mark()
        launched = self._launch(sched, previous)
        self._device_step(start)
        return launched

    def _device_mark(self) -> torch.cuda.Event | None:
        if self.device_steps is None:
            return None
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def _device_step(self, start: torch.cuda.Event | None) -> None:
        if start is not None and self.device_steps is not None:
            self.device_steps.append((start, self._device_mark()))  # type: ignore[arg-type]

    def take_device_ms(self) -> list[float]:
        """The device milliseconds of the steps timed since the last call (all of them complete: call after a sync)."""
        steps, self.device_steps = self.device_steps or [], [] if self.device_steps is not None else None
        return [start.elapsed_time(end) for start, end in steps]

    def _launch(self, sched: SchedulerOutput, previous: Launched | None = None) -> Launched:
        """Queue the step on the device. With `previous` (a step launched and not yet collected), every scheduled
        request continues from it (ScheduledRequest.continues): its input is the token `previous` sampled for it,
        taken on the device, at the position after that step's."""
        if previous is not None:
            input_ids, positions, slots, query_start, seq_lens, tables = self._continued_step_inputs(sched)
            max_query_len = 1
        else:
            input_ids, positions, slots, query_start, seq_lens, tables = [], [], [], [0], [], []
            bs = self.block_size
            max_query_len = 0
            for s in sched.scheduled:
                req = s.request
                start = req.num_computed_tokens
                end = start + s.num_new_tokens
                num_plain = s.num_new_tokens - len(s.spec_token_ids)
                input_ids += req.all_token_ids[start : start + num_plain] + s.spec_token_ids
                positions += range(start, end)
                slots += slots_for(req.block_ids, start, end, bs)
                query_start.append(query_start[-1] + s.num_new_tokens)
                seq_lens.append(end)
                tables.append(req.block_ids)
                max_query_len = max(max_query_len, s.num_new_tokens)
        ids_from = self._continued_inputs(sched, previous)

        taps = self.drafter.tap_layers if self.drafter is not None else ()
        key = self.graphs.pick(len(input_ids), len(seq_lens), max_query_len) if self.graphs is not None else None
        if key is not None:
            assert self.graphs is not None
            logits_all, tapped = self.graphs.replay(
                key, input_ids, positions, slots, query_start, seq_lens, tables, ids_from
            )
            pos, slot_mapping = self.graphs.pos, self.graphs.slots

            def logits_of(rows: list[int]) -> torch.Tensor:
                if rows == list(range(len(input_ids))):  # decode and verification: every row is a logit row
                    return logits_all
                return logits_all[upload(rows, torch.int64, self.device)]

        else:
            hidden, tapped, pos, slot_mapping = self._forward_eager(
                input_ids, positions, slots, query_start, seq_lens, tables, max_query_len, taps, ids_from
            )

            def logits_of(rows: list[int]) -> torch.Tensor:
                return self._logits(hidden, rows)

        launched = Launched(sched)
        if not sched.continued:
            launched.prompt_logprobs = self._prompt_logprobs(sched, logits_of, query_start)
        # A continued step's requests all sample, without drafts or logprobs (StepPolicy.next_step checked
        # them): not asked again, request by request, every step.
        continued = sched.continued
        sampling = sched.scheduled if continued else [s for s in sched.scheduled if s.samples]
        if not continued and any(s.spec_token_ids for s in sched.scheduled):
            out = launched.output = self._verify(sched, logits_of, query_start)
        elif not continued and any(s.request.sampling_params.logprobs is not None for s in sampling):
            # logprobs are read on the host
            out = launched.output = self._sample(sched, logits_of, query_start)
        else:
            out = RunnerOutput({})
            if sampling:
                rows = [query_start[r + 1] - 1 for r, s in enumerate(sched.scheduled) if s.samples]
                known = previous.plain if previous is not None else None
                launched.plain = known or _plain_path(sampling)
                # The fast paths build no SamplingRow per request and step.
                if launched.plain == "greedy":
                    launched.tokens = self.sampler.greedy(logits_of(rows)[: len(rows)])
                elif launched.plain == "temperature":
                    launched.temperature_rows = self._temperature_rows(sampling, previous)
                    launched.tokens = self.sampler.temperature(logits_of(rows), *launched.temperature_rows)
                else:
                    launched.tokens = self.sampler.tokens(
                        logits_of(rows), [sampling_row(s.request, [0] if s.continues else None) for s in sampling]
                    )
                launched.download = Download(launched.tokens)
                if previous is not None and sampling is previous.sched.scheduled:  # the same entries serve again
                    launched.request_ids = previous.request_ids
                else:
                    launched.request_ids = [s.request.request_id for s in sampling]
        in_graph = key is not None and self.graphs is not None and self.graphs.context_writer is not None
        if self.drafter is not None and self.drafter.tap_layers and not in_graph:
            # The drafter's context grows by what the target keeps: every plain token and the accepted drafts.
            if continued or not any(s.spec_token_ids for s in sched.scheduled):
                # No drafts in the step (prompt chunks, plain decode): it keeps every row, so a slice, without a
                # Python list of every row (8192 in a full prefill step), its upload and a gather of the taps.
                n = query_start[-1]
                self.drafter.extend_context(None if tapped is None else tapped[:n], pos[:n], slot_mapping[:n])
                return launched
            keep = [
                i
                for r, s in enumerate(sched.scheduled)
                for i in range(
                    query_start[r],
                    query_start[r]
                    + s.num_new_tokens
                    - len(s.spec_token_ids)
                    + out.num_accepted.get(s.request.request_id, 0),
                )
            ]
            rows = upload(keep, torch.int64, self.device)
            self.drafter.extend_context(None if tapped is None else tapped[rows], pos[rows], slot_mapping[rows])
        return launched

    @torch.inference_mode()
    def launch_pipelined(self, sched: SchedulerOutput, previous: Launched, budget: int, draft: bool) -> Launched:
        """Queue a pipelined speculative step (worker/spec_pipeline.py) continuing `previous`, a pipelined step or a
        plain one (not yet collected): verify `budget` drafts in all, then draft the next block if `draft`."""
        assert self.pipeline is not None
        start = None
        if previous.spec is None:
            assert previous.tokens is not None, "a pipeline starts after a plain sampling step"
            num_new = {s.request.request_id: s.num_new_tokens for s in previous.sched.scheduled}
            start = PlainStart(previous.tokens, previous.request_ids, num_new)
        mark = self._device_mark()
        launched = Launched(sched, spec=self.pipeline.launch(sched, budget, draft, start))
        self._device_step(mark)
        return launched

    def _pipeline_forward(self, ids: torch.Tensor, lay: FlatLayout, num_tokens: int) -> torch.Tensor:
        """A pipelined step's target forward, eagerly: [num_tokens, vocab] fp32 logits of every row, and the drafter's
        context of every real row (a rejected draft's is overwritten by the next block before anything reads it)."""
        lens = lay.seq_lens.tolist()
        num_reqs = next((i for i, n in enumerate(lens) if n == 0), len(lens))  # padding requests (empty) come last
        qs, lens = lay.query_start.tolist()[: num_reqs + 1], lens[:num_reqs]
        pad = rows_for(num_tokens, self.pad_rows) - num_tokens
        pipeline = self.pipeline
        assert pipeline is not None
        meta = AttentionMetadata(
            num_actual_tokens=qs[-1],
            slot_mapping=torch.cat([lay.slots, lay.slots.new_full((pad,), -1)]) if pad else lay.slots,
            query_start_loc=lay.query_start[: num_reqs + 1],
            seq_lens=lay.seq_lens[:num_reqs],
            block_tables=pipeline.tables[:num_reqs],
            query_start_loc_cpu=qs,
            seq_lens_cpu=lens,
            max_query_len=max(b - a for a, b in itertools.pairwise(qs)),
            max_seq_len=max(lens),
        )
        mcfg = self.model.config
        self.backend.prepare(meta, mcfg.num_kv_heads, mcfg.num_heads, self.block_size)
        pos = torch.cat([lay.positions, lay.positions.new_zeros(pad)]) if pad else lay.positions
        x = torch.cat([ids, ids.new_zeros(pad)]) if pad else ids
        taps = self.drafter.tap_layers if self.drafter is not None else ()
        hidden, tapped = self.model.forward_with_taps(
            x, pos, AttentionContext(self.backend, meta, self.kv_caches), taps
        )
        n = qs[-1]
        if self.drafter is not None and tapped is not None:
            self.drafter.extend_context(tapped[:n], pos[:n], meta.slot_mapping[:n])
        return self.model.compute_logits(hidden)[:num_tokens]

    def collect(self, launched: Launched) -> RunnerOutput:
        """The step's output; for a plain sampling step, the one wait for its tokens."""
        out = self._collect(launched)
        if launched.prompt_logprobs:
            out.prompt_logprobs = launched.prompt_logprobs
        return out

    def _collect(self, launched: Launched) -> RunnerOutput:
        if launched.spec is not None:
            return RunnerOutput({}, spec=SpecPipeline.collect(launched.spec))
        if launched.output is not None:
            return launched.output
        if launched.download is None:  # nothing sampled (prompt chunks only)
            return RunnerOutput({})
        tokens = launched.download.wait()[0].tolist()
        if launched.sched.continued:
            return RunnerOutput({}, tokens=tokens)
        return RunnerOutput({rid: [SampledRow(t)] for rid, t in zip(launched.request_ids, tokens, strict=True)})

    def _continued_step_inputs(
        self, sched: SchedulerOutput
    ) -> tuple[list[int], list[int], list[int], list[int], list[int], list[list[int]]]:
        """A continued step's inputs (input ids, positions, slots, query starts, sequence lengths, block tables):
        every request feeds one token, the one the step it continues samples (on the device: its input id here is a
        placeholder), at the position after that step's (its last token is not appended yet).

        A continued step is the steady state of decoding; its inputs are computed a column at a time in numpy, not
        request by request: at high load the host, not the device, bounds a plain step."""
        bs = self.block_size
        reqs = [s.request for s in sched.scheduled]
        n = len(reqs)
        assert sched.continued, "not a continued step"
        pos = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, n) + 1
        blocks = np.fromiter((r.block_ids[b] for r, b in zip(reqs, (pos // bs).tolist(), strict=True)), np.int64, n)
        slots = blocks * bs + pos % bs
        tables = [r.block_ids for r in reqs]
        return [0] * n, pos.tolist(), slots.tolist(), list(range(n + 1)), (pos + 1).tolist(), tables

    def _temperature_rows(
        self, sampling: list[ScheduledRequest], previous: Launched | None
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """The sampling requests' temperatures (on the device), seeds and the output position each samples."""
        if previous is not None and sampling is previous.sched.scheduled and previous.temperature_rows is not None:
            # The same entries continue `previous`, so each samples the position after the one it sampled there
            # (otherwise three lists of R and an upload a step).
            temps, seeds, positions = previous.temperature_rows
            return temps, seeds, positions + 1
        n = len(sampling)
        temps = upload([s.request.sampling_params.temperature for s in sampling], torch.float32, self.device)
        seeds = np.fromiter((s.request.seed for s in sampling), np.int64, n)
        positions = np.fromiter((s.request.num_output_tokens + s.continues for s in sampling), np.int64, n)
        return temps, seeds, positions

    def _continued_inputs(self, sched: SchedulerOutput, previous: Launched | None) -> torch.Tensor | None:
        """The continued requests' input tokens ([n] on the device): what `previous` sampled for them."""
        if previous is None:
            assert not any(s.continues for s in sched.scheduled), "a continued step needs the step it continues"
            return None
        assert previous.tokens is not None
        if sched.scheduled is previous.sched.scheduled:  # the same entries serve again (StepPolicy.next_step)
            return previous.tokens
        ids = [s.request.request_id for s in sched.scheduled]
        if ids == previous.request_ids[: len(ids)]:  # the same rows in the same order (the usual case)
            return previous.tokens[: len(ids)]
        row = {rid: i for i, rid in enumerate(previous.request_ids)}
        return previous.tokens[upload([row[rid] for rid in ids], torch.int64, self.device)]

    def _forward_eager(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        query_start: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        max_query_len: int,
        taps: tuple[int, ...],
        ids_from: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        num_actual = len(input_ids)
        pad = rows_for(num_actual, self.pad_rows) - num_actual  # padding rows: token 0, position 0, slot -1
        dev = self.device
        max_blocks = max(len(t) for t in tables)
        slot_mapping = upload(slots + [-1] * pad, torch.int64, dev)
        meta = AttentionMetadata(
            num_actual_tokens=num_actual,
            slot_mapping=slot_mapping,
            query_start_loc=upload(query_start, torch.int32, dev),
            seq_lens=upload(seq_lens, torch.int32, dev),
            block_tables=upload_tensor(
                torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32), dev
            ),
            query_start_loc_cpu=query_start,
            seq_lens_cpu=seq_lens,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
        )
        mcfg = self.model.config
        self.backend.prepare(meta, mcfg.num_kv_heads, mcfg.num_heads, self.block_size)
        ids = upload(input_ids + [0] * pad, torch.int64, dev)
        if ids_from is not None:
            ids[:num_actual].copy_(ids_from)
        pos = upload(positions + [0] * pad, torch.int64, dev)
        hidden, tapped = self.model.forward_with_taps(
            ids, pos, AttentionContext(self.backend, meta, self.kv_caches), taps
        )
        return hidden, tapped, pos, slot_mapping

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """fp32 logits of these rows of the step ([len(rows) padded to a multiple of 4, vocab])."""
        padded = rows + [rows[-1]] * (rows_for(len(rows), self.pad_rows) - len(rows))
        return self.model.compute_logits(hidden[upload(padded, torch.int64, self.device)])

    def _prompt_logprobs(
        self, sched: SchedulerOutput, logits_of: LogitsOf, query_start: list[int]
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """SamplingParams.prompt_logprobs of this step's prompt chunks: at each chunk position p before the prompt's
        last, prompt token p + 1's logprob, its rank (1 + the tokens more likely) and the top N. Read on the host at
        once, PROMPT_LOGPROB_ROWS rows at a time (a vocabulary-wide fp32 row each): requests that ask are rare."""
        asks = []
        for r, s in enumerate(sched.scheduled):
            req = s.request
            n = len(req.prompt_token_ids)
            if req.sampling_params.prompt_logprobs is not None and req.num_computed_tokens < n - 1:
                start = req.num_computed_tokens
                asks.append((r, req, start, min(start + s.num_new_tokens, n - 1)))  # the last predicts an output
        if not asks:
            return {}
        rows = [query_start[r] + i for r, _, start, stop in asks for i in range(stop - start)]
        targets = [t for _, req, start, stop in asks for t in req.prompt_token_ids[start + 1 : stop + 1]]
        top_n = max(req.sampling_params.prompt_logprobs or 0 for _, req, _, _ in asks)
        chosen, ranks, top_ids, top_lps = [], [], [], []
        for at in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            piece = rows[at : at + PROMPT_LOGPROB_ROWS]
            logprobs = torch.log_softmax(logits_of(piece)[: len(piece)].float(), dim=-1)
            target = torch.tensor(targets[at : at + len(piece)], device=logprobs.device)
            lp = logprobs.gather(1, target[:, None])[:, 0]
            chosen += lp.tolist()
            ranks += ((logprobs > lp[:, None]).sum(1) + 1).tolist()
            if top_n:
                values, ids = logprobs.topk(top_n, dim=-1)
                top_lps += values.tolist()
                top_ids += ids.tolist()
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        j = 0
        for _, req, start, stop in asks:
            k = req.sampling_params.prompt_logprobs or 0
            entries: list[TokenLogprobs] = []
            for i in range(j, j + stop - start):
                entries.append(
                    (chosen[i], ranks[i], list(zip(top_ids[i][:k], top_lps[i][:k], strict=True)) if k else [])
                )
            out[req.request_id] = (start, entries)
            j += stop - start
        return out

    def _sample(self, sched: SchedulerOutput, logits_of: LogitsOf, query_start: list[int]) -> RunnerOutput:
        sampling = [(r, s) for r, s in enumerate(sched.scheduled) if s.samples]
        if not sampling:
            return RunnerOutput({})
        logits = logits_of([query_start[r + 1] - 1 for r, _ in sampling])
        sampled = self.sampler(logits, [sampling_row(s.request) for _, s in sampling])
        return RunnerOutput({s.request.request_id: [row] for (_, s), row in zip(sampling, sampled, strict=True)})

    def _verify(self, sched: SchedulerOutput, logits_of: LogitsOf, query_start: list[int]) -> RunnerOutput:
        """Every sampling request verifies its l drafts (0..K) on its last l + 1 rows, each row shaped by the same
        sampling row the plain sampler would use at that output position."""
        sampling = [(r, s) for r, s in enumerate(sched.scheduled) if s.samples]
        if self.plain_verify and all(_plain_verify(s.request) for _, s in sampling):
            return self._verify_plain(sampling, logits_of, query_start)
        logit_rows: list[int] = []
        rows: list[SamplingRow] = []
        vrows: list[VerifyRow] = []
        for r, s in sampling:
            n = len(s.spec_token_ids)
            logit_rows += range(query_start[r + 1] - n - 1, query_start[r + 1])
            rows += [sampling_row(s.request, s.spec_token_ids[:j]) for j in range(n + 1)]
            vrows.append(VerifyRow(s.request.seed, s.request.num_output_tokens, s.spec_token_ids, rows[-1].greedy))
        logits = logits_of(logit_rows)
        target_probs = logits_to_probs(logits, rows)
        draft_probs = None
        if self.verify_method == "probabilistic" and not all(v.greedy for v in vrows):
            draft_probs = self._pending_probs(sampling)
        emitted = verify(target_probs, draft_probs, vrows, self.verify_method)

        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(r.num_logprobs is not None for r in rows) else None
        out = RunnerOutput({})
        first = 0
        for (_, s), tokens in zip(sampling, emitted, strict=True):
            rid = s.request.request_id
            out.sampled[rid] = [
                self.sampler.describe(tok, raw_logprobs, first + j, rows[first + j]) for j, tok in enumerate(tokens)
            ]
            if s.spec_token_ids:
                out.num_accepted[rid] = len(tokens) - 1
            first += len(s.spec_token_ids) + 1
        return out

    def _verify_plain(
        self, sampling: list[tuple[int, ScheduledRequest]], logits_of: LogitsOf, query_start: list[int]
    ) -> RunnerOutput:
        """_verify for requests on the greedy or temperature sampling path, without logprobs: decided on the device
        (verify_plain), the host reads two numbers a request in one copy."""
        logit_rows: list[int] = []
        vrows: list[VerifyRow] = []
        for r, s in sampling:
            n = len(s.spec_token_ids)
            logit_rows += range(query_start[r + 1] - n - 1, query_start[r + 1])
            greedy = s.request.sampling_path == "greedy"
            vrows.append(VerifyRow(s.request.seed, s.request.num_output_tokens, s.spec_token_ids, greedy))
        draft_probs = None
        if self.verify_method == "probabilistic" and not all(v.greedy for v in vrows):
            draft_probs = self._pending_probs(sampling)
        temps = [s.request.sampling_params.temperature for _, s in sampling]
        accepted, last = download(*verify_plain(logits_of(logit_rows), draft_probs, vrows, temps, self.verify_method))
        out = RunnerOutput({})
        for (_, s), v, a, token in zip(sampling, vrows, accepted, last, strict=True):
            rid = s.request.request_id
            out.sampled[rid] = [SampledRow(t) for t in v.draft_tokens[:a]] + [SampledRow(token)]
            if s.spec_token_ids:
                out.num_accepted[rid] = a
        return out

    def _pending_probs(self, sampling: list[tuple[int, ScheduledRequest]]) -> torch.Tensor:
        """[sum of drafts, vocab]: the distribution each verified draft was drawn from, requests back to back."""
        vocab = self.model.config.vocab_size
        held = [self._draft_probs.get(s.request.request_id) for _, s in sampling]
        first = held[0]
        if first is not None and all(h is not None and h[0] is first[0] for h in held):
            # Drafted in one pass (the steady state): one gather, not a slice per request and a cat of them all (two
            # small host ops a request).
            k = first[0].shape[1]
            rows = [h[1] for h in held if h is not None]
            flat = [r * k + j for r, (_, s) in zip(rows, sampling, strict=True) for j in range(len(s.spec_token_ids))]
            return first[0].view(-1, vocab)[upload(flat, torch.int64, self.device)]
        parts = []
        for h, (_, s) in zip(held, sampling, strict=True):
            n = len(s.spec_token_ids)
            if h is not None or not n:
                parts.append(h[0][h[1], :n] if h is not None else torch.empty(0, vocab, device=self.device))
                continue
            # Drafted in an all-greedy pass, verified beside a sampled row: greedy rows are verified by argmax and
            # never read their distribution, which that pass did not compute.
            assert s.request.sampling_params.greedy, (
                f"request {s.request.request_id}: sampled drafts without a distribution"
            )
            parts.append(torch.zeros(n, vocab, device=self.device))
        return torch.cat(parts)

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> Proposal:
        """Drafts for the next step of these requests (each has all but its last token computed)."""
        assert self.drafter is not None
        proposal = self.drafter.propose(requests)
        for i, req in enumerate(requests):
            if proposal.probs is not None:
                self._draft_probs[req.request_id] = (proposal.probs, i)
            else:  # an all-greedy pass: an older pass's distribution must not pass for this one's
                self._draft_probs.pop(req.request_id, None)
        return proposal

    def release(self, request_id: str, finished: bool = True) -> None:
        """Forget a request's pending drafts; when it finished, the drafter's per-request state too."""
        self._draft_probs.pop(request_id, None)
        flush = getattr(self.drafter, "flush_context", None)
        if flush is not None:  # deferred context rows, before their blocks go to another request or a cache hit
            flush()
        release = getattr(self.drafter, "release", None)
        if finished and release is not None:
            release(request_id)


def _plain_path(sampling: list[ScheduledRequest]) -> str | None:
    """The fast path every sampling request has ("greedy" or "temperature"), or None where they differ or any request
    takes the general path."""
    path = sampling[0].request.sampling_path
    if path == "general" or any(s.request.sampling_path != path for s in sampling):
        return None
    return path


def _plain_verify(req: Request) -> bool:
    """Whether verification may take verify_plain for the request: a fast sampling path, and no logprobs."""
    return req.sampling_path != "general" and req.sampling_params.logprobs is None


def sampling_row(req: Request, drafts: list[int] | None = None) -> SamplingRow:
    """The sampling inputs of the request's next output token, or, with drafts, of the token after those drafts."""
    p = req.sampling_params
    num_out = req.num_output_tokens + len(drafts or ())
    banned: tuple[int, ...] = ()
    if num_out < p.min_tokens:
        eos = () if p.ignore_eos or req.eos_token_id is None else (req.eos_token_id,)
        banned = (*eos, *p.stop_token_ids)
    # The token lists are read only by the penalties; without them a copy per request and step is wasted.
    outputs = (req.output_token_ids + drafts if drafts else req.output_token_ids) if p.has_penalties else []
    return SamplingRow(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        seed=req.seed,
        counter=num_out,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=outputs,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        banned_token_ids=banned,
        num_logprobs=p.logprobs,
    )
