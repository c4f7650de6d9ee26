"""Pipelined speculative steps: verification and drafting on the device, launched a step ahead of the host.

A pipelined step verifies the drafts the previous step drafted and drafts the next block, with the host nowhere in
between. The host gives it a verification budget B, chosen from survivals one or two steps old (so whether a draft is
verified never depends on its own value); on the device the step then

1. gathers the per-request state of the requests that continue (row_from: a request's row in the step before),
2. allocates the top-B live survivals (speculative/budget.py: allocate, ties broken by place, never by value),
3. lays out the flattened batch (input ids, positions, KV slots, query starts: budget.flat_layout),
4. runs the target (and writes the drafter's context of every row),
5. verifies (sample/rejection.py: verify_on_device, greedy and rejection sampling, the same draws as the host path),
6. appends the accepted drafts and the bonus token to the per-request state,
7. drafts the next block from the new last tokens (the DSpark block forward, Markov head and confidences), and
8. smooths the confidences (EMA) into the live survivals the next step allocates from.

Its outputs (emitted tokens, counts, survivals) reach the host by one asynchronous copy that the host reads after it
has launched the next step (async scheduling): a request that this step ends has the next step's work voided.

The state lives in rows: row i is the i-th request of the step that wrote it. On CUDA, steps 1-6 are one CUDA graph
per padded token count and steps 7-8 one per padded request count; elsewhere (CPU, enforce_eager) the same functions
run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dspark.attention.base import AttentionBackend, AttentionMetadata
from dspark.core.request import Request
from dspark.core.scheduler import SchedulerOutput
from dspark.sample.ops import softmax_temperatures
from dspark.sample.random import DRAFT_STREAM, stream_seeds, uniforms_at
from dspark.sample.rejection import VERIFY_STREAMS, verify_on_device
from dspark.speculative.budget import FlatLayout, allocate, flat_layout
from dspark.speculative.drafters.dspark.drafter import DSparkDrafter
from dspark.utils.capture import capture_sizes
from dspark.utils.numerics import padded_rows, rows_for
from dspark.worker.cuda_graphs import GraphRunner

MIN_CONFIDENCE = 1e-4  # a drafted slot keeps a positive survival: 0 means "no draft here" to allocate
KEY_STREAMS = (*VERIFY_STREAMS, DRAFT_STREAM)  # the random streams whose keys a row holds (consts[:, 4:8])


@dataclass
class SpecLaunch:
    """A pipelined step on its way: its outputs' copy to the host and what the host asked of it."""

    num_rows: int
    budget: int
    drafted: bool
    out_i: torch.Tensor  # [rows, k + 3] int64 host: emitted tokens (k + 1), how many emitted, how many verified
    out_f: torch.Tensor  # [rows, 2k] fp32 host: survivals and raw confidences of the new drafts
    done: torch.cuda.Event | None  # None: the copy is complete (CPU)


@dataclass
class PlainStart:
    """The plain step a pipeline starts after (launched, not yet collected): its sampled tokens on the device."""

    tokens: torch.Tensor  # [n] int64: the sampling requests' tokens, in the order of request_ids
    request_ids: list[str]
    num_new: dict[str, int]  # request id -> tokens that step computes for it


@dataclass
class SpecResult:
    """A pipelined step's outputs on the host, one row per request in the step's order."""

    tokens: np.ndarray  # [R, k + 1] int64: accepted drafts, then the bonus or corrected token (num_emitted of them)
    num_emitted: np.ndarray  # [R] int64 (0 for a request that did not run)
    num_verified: np.ndarray  # [R] int64: drafts it verified
    survivals: np.ndarray | None  # [R, 2k] float64: the new drafts' survivals, then their raw confidences


class SpecPipeline:
    def __init__(
        self,
        drafter: DSparkDrafter,
        forward: Callable[..., torch.Tensor],
        device: torch.device,
        max_rows: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        method: str,
        ema_alpha: float = 0.0,
    ) -> None:
        """forward(ids, layout, num_tokens) -> [num_tokens, vocab] fp32 logits: the target's eager forward over a
        layout (with the drafter's context write of every real row); graphs capture their own."""
        self.drafter, self.forward, self.device = drafter, forward, device
        self.k = k = drafter.max_num_tokens
        self.block = drafter.model.config.block_size
        self.max_rows, self.block_size, self.vocab_size = max_rows, block_size, vocab_size
        self.method = method
        self.alpha = ema_alpha
        self.sample = drafter.sample
        i64 = {"dtype": torch.int64, "device": device}
        f32 = {"dtype": torch.float32, "device": device}
        # Per-request state, carried from step to step (rows in the order of the step that wrote them). It lives in
        # two tables, one int64 and one fp32, so that a step gathers its rows in two ops (each op of a step is a
        # kernel); the names below are views of their columns.
        self.state_i = torch.zeros(max_rows, 3 + k + 4 + len(KEY_STREAMS), **i64)
        self.state_f = torch.zeros(max_rows, 2 * k + 2, **f32)
        self.last_token = self.state_i[:, 0]  # the token each request feeds next
        self.num_computed = self.state_i[:, 1]  # tokens with KV: last_token sits at this position
        self.num_output = self.state_i[:, 2]  # output tokens, last_token included: the next RNG counter
        self.drafts = self.state_i[:, 3 : 3 + k]
        # Per-request constants: greedy, draft cap, end_at, prompt length, then the seed's keys of the verification
        # streams and the drafting stream (random.stream_seeds).
        self.consts = self.state_i[:, 3 + k :]
        self.survival = self.state_f[:, :k]  # 0: no draft
        self.smoothed = self.state_f[:, k : 2 * k]  # the EMA of the calibrated confidences
        self.temperature = self.state_f[:, 2 * k]
        self.temperature.fill_(1.0)  # rows never started are padding: a finite softmax
        self.history = self.state_f[:, 2 * k + 1]  # 1: smoothed holds a value
        # [k, rows, vocab]: what each draft was drawn from (probabilistic drafting), position-major so that the drafter
        # writes each position's rows in place (sample_block_with's probs_out); zeros are a valid "no draft"
        self.draft_probs = torch.zeros(k, max_rows, vocab_size, **f32) if self.sample else None
        # Per step, from the host: the budget, the number of rows and each row's row in the step before.
        self.ctrl = torch.zeros(2 + max_rows, **i64)
        # 0, 1, 2, ...: a step slices its index ranges from it rather than making each (a kernel each); grown to the
        # largest padded step before graphs are captured (_grow_iota).
        self.iota = torch.arange(max(max_rows * (k + 1), 2 * k + 1, self.block) + 1, **i64)
        self.valid = torch.zeros(max_rows, dtype=torch.bool, device=device)  # the rows of this step's requests
        self.max_blocks = -(-(max_model_len + self.block) // block_size)
        self.tables = torch.zeros(max_rows, self.max_blocks, dtype=torch.int32, device=device)
        self.out_i = torch.zeros(max_rows, k + 3, **i64)
        self.out_f = torch.zeros(max_rows, 2 * k, **f32)
        pin = {"pin_memory": True} if device.type == "cuda" else {}
        self.h_ctrl = torch.zeros(2 + max_rows, dtype=torch.int64, **pin)
        self.h_tables = torch.zeros(max_rows, self.max_blocks, dtype=torch.int32, **pin)
        self.h_init = torch.zeros(3 + self.consts.shape[1], max_rows, dtype=torch.int64, **pin)
        self.h_temps = torch.zeros(max_rows, dtype=torch.float32, **pin)
        # Two host copies of the outputs, alternating: a step's copy lands while the host still reads the last one's.
        self.h_out = [
            (torch.zeros(max_rows, k + 3, dtype=torch.int64, **pin), torch.zeros(max_rows, 2 * k, **pin))
            for _ in range(2)
        ]
        self._flip = 0
        self._rows: list[str] = []  # the request ids of the rows the last launched step wrote
        self._scheduled: list | None = None  # that step's entries (the same list again: the same rows)
        self._sampled = False  # some row samples (else every verification and draft is an argmax)
        self._staged_copy: torch.cuda.Event | None = None  # recorded after the last step's uploads were queued
        self._tables_of: list[list[int] | None] = []
        self._staged: list[int] = []
        self.graphs_a: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.graphs_b: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.sizes_a: list[int] = []
        self.sizes_b: list[int] = []
        self.num_launched = 0
        self.num_graph_replays = 0  # steps 1-6 replayed from a graph
        self.pad_eagerly = False  # run eager steps at the graphs' padded shapes (pad_like_graphs)

    # ---- the host side ---------------------------------------------------------------------------------------------

    def launch(
        self, sched: SchedulerOutput, budget: int, draft: bool, previous: PlainStart | None = None
    ) -> SpecLaunch:
        """Queue a pipelined step for sched's requests, each continuing a step launched before and not yet collected:
        the last pipelined one, or (`previous`) a plain one, whose sampled tokens are still on the device. budget:
        drafts to verify in all (B); draft: whether to draft the next block."""
        reqs = [s.request for s in sched.scheduled]
        num_rows = len(reqs)
        assert 0 < num_rows <= self.max_rows, num_rows
        if self._staged_copy is not None:  # the last step's copies out of the host staging buffers have run
            self._staged_copy.synchronize()
        ctrl = self.h_ctrl.numpy()
        if previous is not None:
            self._start(reqs, previous)
            ctrl[2 : 2 + num_rows] = np.arange(num_rows)
        elif sched.scheduled is not self._scheduled:  # the same entries in the same rows otherwise
            row_of = {rid: i for i, rid in enumerate(self._rows)}
            ctrl[2 : 2 + num_rows] = [row_of[r.request_id] for r in reqs]
            self._sampled = any(r.sampling_path != "greedy" for r in reqs)
        else:
            ctrl[2 : 2 + num_rows] = np.arange(num_rows)
        self._scheduled = sched.scheduled
        self._rows = [r.request_id for r in reqs]
        budget = max(0, min(budget, num_rows * self.k))
        ctrl[0], ctrl[1] = budget, num_rows
        self.ctrl.copy_(self.h_ctrl, non_blocking=True)
        self._stage_tables(reqs)
        if self.device.type == "cuda":
            self._staged_copy = torch.cuda.Event()
            self._staged_copy.record()
        sampled = self._sampled
        num_tokens = num_rows + budget
        key_a = next((t for t in self.sizes_a if t >= num_tokens), None)
        if key_a is not None and (key_a, sampled) in self.graphs_a:
            self.graphs_a[key_a, sampled].replay()
            self.num_graph_replays += 1
        elif key_a is not None and self.pad_eagerly:  # the graphs' padded shapes, run eagerly (tests)
            self.run_a(min(key_a, self.max_rows), key_a, sampled)
        else:
            self.run_a(num_rows, num_tokens, sampled)
        if draft:
            sample = self.sample and sampled
            key_b = next((r for r in self.sizes_b if r >= num_rows), None)
            if key_b is not None and (key_b, sample) in self.graphs_b:
                self.graphs_b[key_b, sample].replay()
            else:
                self.run_b(key_b if key_b is not None and self.pad_eagerly else num_rows, sample)
        else:
            self.survival[:num_rows].zero_()  # nothing drafted: the next step verifies nothing
        out_i, out_f = self.h_out[self._flip]
        self._flip ^= 1
        out_i[:num_rows].copy_(self.out_i[:num_rows], non_blocking=True)
        if draft:
            out_f[:num_rows].copy_(self.out_f[:num_rows], non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self.num_launched += 1
        return SpecLaunch(num_rows, budget, draft, out_i, out_f, done)

    @staticmethod
    def collect(launch: SpecLaunch) -> SpecResult:
        """The step's outputs, once their copy has landed (the one wait)."""
        if launch.done is not None:
            launch.done.synchronize()
        n = launch.num_rows
        out = launch.out_i.numpy()[:n]
        k = out.shape[1] - 3
        survivals = launch.out_f.numpy()[:n].astype(np.float64) if launch.drafted else None
        return SpecResult(out[:, : k + 1], out[:, k + 1], out[:, k + 2], survivals)

    def _start(self, reqs: list[Request], previous: PlainStart) -> None:
        """The rows of a pipeline that starts after a plain step (launched, not collected): each request's last token
        is what that step samples for it (on the device), after the tokens that step computes for it."""
        n = len(reqs)
        row_of = {rid: i for i, rid in enumerate(previous.request_ids)}
        init = self.h_init.numpy()
        init[0, :n] = [r.num_computed_tokens + previous.num_new[r.request_id] for r in reqs]
        init[1, :n] = [r.num_output_tokens + 1 for r in reqs]  # the plain step's sample becomes an output
        init[2, :n] = [row_of[r.request_id] for r in reqs]
        init[3, :n] = [r.sampling_path == "greedy" for r in reqs]
        k = self.k
        init[4, :n] = [min(k, r.sampling_params.max_speculative_tokens or k) for r in reqs]
        init[5, :n] = [r.end_at for r in reqs]
        init[6, :n] = [len(r.prompt_token_ids) for r in reqs]
        init[7:, :n] = stream_seeds([r.seed for r in reqs], KEY_STREAMS).T
        init_dev = self.h_init[:, :n].to(self.device, non_blocking=True)
        self.num_computed[:n] = init_dev[0]
        self.num_output[:n] = init_dev[1]
        self.consts[:n] = init_dev[3:].t()
        self.last_token[:n] = previous.tokens[init_dev[2]]
        self.h_temps.numpy()[:n] = softmax_temperatures([r.sampling_params.temperature for r in reqs])
        self.temperature[:n].copy_(self.h_temps[:n], non_blocking=True)
        self.survival[:n].zero_()
        self.history[:n] = 0.0
        self._sampled = not bool(init[3, :n].all())

    def _stage_tables(self, reqs: list[Request]) -> None:
        """The requests' block tables, rewriting of each row only what was added since it was staged (a request's
        block list only grows while it holds its blocks)."""
        host = self.h_tables.numpy()
        while len(self._tables_of) < len(reqs):
            self._tables_of.append(None)
            self._staged.append(0)
        width = 0
        for i, r in enumerate(reqs):
            b = r.block_ids
            start = self._staged[i] if self._tables_of[i] is b else 0
            if len(b) > start:
                host[i, start : len(b)] = b[start:]
            self._tables_of[i], self._staged[i] = b, len(b)
            width = max(width, len(b))
        n = len(reqs)
        self.tables[:n, :width].copy_(self.h_tables[:n, :width], non_blocking=True)

    # ---- the device side (captured in graphs on CUDA) --------------------------------------------------------------

    def run_a(self, r: int, num_tokens: int, sampled: bool) -> torch.Tensor:
        """Steps 1-6 over r row slots and num_tokens flattened rows (both padded on CUDA): returns the logits."""
        ids, lay, ell = self.prologue_a(r, num_tokens)
        logits = self.forward(ids, lay, num_tokens)
        self.epilogue_a(r, logits, lay, ell, sampled)
        return logits

    def prologue_a(self, r: int, num_tokens: int) -> tuple[torch.Tensor, FlatLayout, torch.Tensor]:
        """Gather the continuing requests' rows, allocate the budget over their live survivals and lay out the step."""
        k = self.k
        row_from = self.ctrl[2 : 2 + r]
        self.state_i[:r] = self.state_i[row_from]
        self.state_f[:r] = self.state_f[row_from]
        # Which rows hold a request, for every part of the step (the drafting graph's included).
        torch.lt(self.iota[: self.max_rows], self.ctrl[1], out=self.valid)
        valid = self.valid[:r]
        _, cap, end_at, num_prompt = self.consts[:r, :4].unbind(1)
        room = (end_at - num_prompt - self.num_output[:r] - 1).clamp(min=0)  # tokens it may still emit after one
        caps = torch.where(valid, torch.minimum(cap, room), 0)
        ell = allocate(self.survival[:r], self.ctrl[0:1], caps)
        lay = flat_layout(
            valid.long(), ell, self.num_computed[:r], self.tables[:r], self.block_size, num_tokens, self.iota
        )
        drafted = self.drafts[:r][lay.owner, (lay.offset - 1).clamp(0, k - 1)]
        ids = torch.where(lay.offset == 0, self.last_token[:r][lay.owner], drafted)
        return torch.where(lay.real, ids, 0), lay, ell

    def epilogue_a(self, r: int, logits: torch.Tensor, lay: FlatLayout, ell: torch.Tensor, sampled: bool) -> None:
        """Verify, emit, and append what was emitted to the rows."""
        k = self.k
        greedy, keys = self.consts[:r, 0], self.consts[:r, 4:7]
        j = self.iota[:k]
        # the drafts' rows in the step that drew them (draft_probs is position-major)
        draft_index = j[None, :] * self.max_rows + self.ctrl[2 : 2 + r, None]
        num_accepted, last = verify_on_device(
            logits,
            lay.query_start[:-1].long(),
            ell,
            self.drafts[:r],
            greedy != 0,
            self.temperature[:r] if sampled else None,
            keys,
            self.num_output[:r],
            None if self.draft_probs is None else self.draft_probs.view(-1, self.vocab_size),
            draft_index,
            lay.owner,
            lay.offset,
            self.method,
            self.iota,
        )
        valid = self.valid[:r]
        jj = self.iota[None, : k + 1]
        emitted = torch.where(
            jj < num_accepted[:, None], torch.cat([self.drafts[:r], self.drafts[:r, :1]], 1), last[:, None]
        )
        num_emitted = torch.where(valid, num_accepted + 1, 0)
        self.out_i[:r, : k + 1] = torch.where(jj <= num_accepted[:, None], emitted, 0)
        self.out_i[:r, k + 1] = num_emitted
        self.out_i[:r, k + 2] = torch.where(valid, ell, 0)
        self.state_i[:r, 1:3] += num_emitted[:, None]  # num_computed and num_output
        self.last_token[:r] = torch.where(valid, last, self.last_token[:r])

    def run_b(self, r: int, sample: bool) -> None:
        """Steps 7-8 over r row slots: draft the next block from each row's new last token."""
        anchors, positions, meta, temps, greedy, u_all = self.prologue_b(r, sample)
        self.drafter.flush_context()  # deferred context rows (the fast CPU path), before the block reads them
        backend = self.drafter.backend
        tokens, _, confidences = self.drafter.block(
            backend, meta, anchors, positions, temps, greedy, u_all, self._probs_out(r, sample)
        )
        self.epilogue_b(r, tokens, confidences)

    def prologue_b(
        self, r: int, sample: bool, meta_out: AttentionMetadata | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The block's inputs from the rows: its anchor (the last token) at the position after the computed ones. Reads
        `valid`, which this step's prologue_a wrote: steps 7-8 run only after steps 1-6 of the same launch."""
        K, bs = self.block, self.block_size
        valid = self.valid[:r]
        anchor_pos = self.num_computed[:r]
        pos = anchor_pos[:, None] + self.iota[None, :K]  # [r, K]
        column = (pos // bs).clamp(max=self.max_blocks - 1)
        slots = self.tables[:r].long().gather(1, column) * bs + pos % bs
        slots = torch.where(valid[:, None], slots, -1).reshape(-1)
        seq_lens = torch.where(valid, anchor_pos + K, 0).to(torch.int32)
        rows_before = torch.minimum(self.iota[: r + 1], self.ctrl[1])
        query_start = (rows_before * K).to(torch.int32)
        num_tokens = r * K
        pad = rows_for(num_tokens, self.drafter.pad_rows) - num_tokens
        positions = torch.cat([pos.reshape(-1), pos.new_zeros(pad)]) if pad else pos.reshape(-1)
        slots = torch.cat([slots, slots.new_full((pad,), -1)]) if pad else slots
        if meta_out is None:  # eager: the real requests only, with the host lists the torch backend reads
            n = int(self.ctrl[1])
            meta = AttentionMetadata(
                num_actual_tokens=n * K,
                slot_mapping=slots,
                query_start_loc=query_start[: n + 1],
                seq_lens=seq_lens[:n],
                block_tables=self.tables[:n],
                query_start_loc_cpu=query_start[: n + 1].tolist(),
                seq_lens_cpu=seq_lens[:n].tolist(),
                max_query_len=K,
                max_seq_len=int(seq_lens.max()),
                causal=False,
            )
        else:
            meta = meta_out
            meta.slot_mapping[: slots.shape[0]].copy_(slots)
            meta.query_start_loc.copy_(query_start)
            meta.seq_lens.copy_(seq_lens)
            meta.block_tables.copy_(self.tables[:r, : meta.block_tables.shape[1]])
        greedy, key = self.consts[:r, 0], self.consts[:r, 7]
        u_all = None
        if sample:
            counters = self.num_output[:r, None] + self.iota[None, : self.k]
            u_all = uniforms_at(key[:, None].expand(r, self.k), counters)
        return self.last_token[:r], positions, meta, self.temperature[:r], greedy != 0, u_all

    def _probs_out(self, r: int, sample: bool) -> torch.Tensor | None:
        """Where a sampling block writes its distributions: the first r rows of every position."""
        return self.draft_probs[:, :r] if sample and self.draft_probs is not None else None

    def epilogue_b(self, r: int, tokens: torch.Tensor, confidences: torch.Tensor | None) -> None:
        """The new drafts (their distributions are in draft_probs already), their EMA-smoothed confidences and live
        survivals, into the rows and the outputs."""
        k = self.k
        assert confidences is not None, "the pipeline needs a drafter with a confidence head"
        current = confidences.float().clamp(MIN_CONFIDENCE, 1.0)
        if self.alpha > 0:
            mixed = self.alpha * self.smoothed[:r] + (1.0 - self.alpha) * current
            smoothed = torch.where(self.history[:r, None] > 0, mixed, current)
        else:
            smoothed = current
        valid = self.valid[:r]
        survival = torch.where(valid[:, None], torch.cumprod(smoothed, dim=1), 0.0)
        self.drafts[:r] = tokens
        self.smoothed[:r] = smoothed
        self.survival[:r] = survival
        self.history[:r] = valid
        self.out_f[:r, :k] = survival
        self.out_f[:r, k:] = current

    def pad_like_graphs(self, max_tokens: int) -> None:
        """Run eager steps at the shapes graphs would be captured for (padding rows and tokens included): what a
        CPU test needs to reach the graphs' padding."""
        self.sizes_a = capture_sizes(max_tokens)
        self.sizes_b = capture_sizes(self.max_rows)
        self._grow_iota(max(self.sizes_a))
        self.pad_eagerly = True

    def _grow_iota(self, num_tokens: int) -> None:
        """iota long enough for a step of num_tokens rows (its layout's row indices)."""
        if self.iota.numel() <= num_tokens:
            self.iota = torch.arange(num_tokens + 1, dtype=torch.int64, device=self.device)

    # ---- CUDA graphs -----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self, target: GraphRunner, backend_factory: Callable[[], AttentionBackend]) -> None:
        """Capture pipelined steps: steps 1-6 for every padded token count of the target's verification graphs (the
        target's forward over its static buffers), steps 7-8 for every padded request count; each in an argmax
        variant and one that samples. Captured with every row invalid (ctrl's row count 0): nothing is written."""
        q = self.k + 1
        self.sizes_a = list(target.sizes.get(q, []))
        self._grow_iota(max(self.sizes_a, default=0))
        self.sizes_b = capture_sizes(self.max_rows)
        K = self.block
        n = self.sizes_b[-1] * K
        dev = self.device
        self.b_slots = torch.full((padded_rows(n),), -1, dtype=torch.int64, device=dev)
        self.b_qsl = torch.zeros(self.sizes_b[-1] + 1, dtype=torch.int32, device=dev)
        self.b_lens = torch.zeros(self.sizes_b[-1], dtype=torch.int32, device=dev)
        self.b_tables = torch.zeros(self.sizes_b[-1], self.max_blocks, dtype=torch.int32, device=dev)
        self.ctrl.zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for t in reversed(self.sizes_a):
                r = min(t, self.max_rows)
                for sampled in (True, False):
                    backend = backend_factory()

                    def step_a(t: int = t, r: int = r, sampled: bool = sampled, backend: AttentionBackend = backend):
                        ids, lay, ell = self.prologue_a(r, t)
                        target.ids[:t].copy_(ids)
                        target.pos[:t].copy_(lay.positions)
                        target.slots[:t].copy_(lay.slots)
                        target.qsl[: r + 1].copy_(lay.query_start)
                        target.lens[:r].copy_(lay.seq_lens)
                        target.tables[:r].copy_(self.tables[:r, : target.tables.shape[1]])
                        target.forward_static(backend, t, r, q)
                        self.epilogue_a(r, target.logits[:t], lay, ell, sampled)

                    self.graphs_a[t, sampled] = _capture(step_a, pool, stream)
            for r in reversed(self.sizes_b):
                for sample in (True, False) if self.sample else (False,):
                    backend = type(self.drafter.backend)()
                    meta = AttentionMetadata(
                        num_actual_tokens=r * K,
                        slot_mapping=self.b_slots[: padded_rows(r * K)],
                        query_start_loc=self.b_qsl[: r + 1],
                        seq_lens=self.b_lens[:r],
                        block_tables=self.b_tables[:r],
                        query_start_loc_cpu=[],
                        seq_lens_cpu=[],
                        max_query_len=K,
                        max_seq_len=self.max_blocks * self.block_size,
                        causal=False,
                    )

                    def step_b(r: int = r, sample: bool = sample, backend: object = backend, meta=meta) -> None:
                        anchors, positions, m, temps, greedy, u_all = self.prologue_b(r, sample, meta)
                        tokens, _, conf = self.drafter.block(
                            backend,  # type: ignore[arg-type]
                            m,
                            anchors,
                            positions,
                            temps,
                            greedy,
                            u_all,
                            self._probs_out(r, sample),
                        )
                        self.epilogue_b(r, tokens, conf)

                    self.graphs_b[r, sample] = _capture(step_b, pool, stream)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)


def _capture(body: Callable[[], None], pool: object, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """body warmed up once (Triton compiles, handles), then captured."""
    body()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        body()
    return graph
