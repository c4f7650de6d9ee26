"""CUDA graphs of the target's forward for steps without long queries: decode and speculative verification.

A 135M-parameter model's decode step is a few hundred small kernels; launched one by one from Python they cost more
than they compute. Each graph is captured once, on a grid of padded token counts T, for a promised longest query q
(1: plain decode; K + 1: verification), with R = min(T, max_num_seqs) request slots. A step with n <= T tokens from
r <= R requests and no query longer than q replays the smallest graph that fits:

- inputs live in static device buffers filled by non_blocking copies from pinned staging (no host sync);
- padding tokens have slot -1 (the KV write skips them) and sit past query_start_loc[r]; padding request slots are
  empty (no tokens, seq_len 0), so padding neither writes to the cache nor changes a real row's attention. (vLLM
  keeps every captured request slot non-empty instead; the Triton kernel treats an empty slot as no work, which
  needs no fake tokens.)
- the attention metadata's host-side maxima are upper bounds fixed at capture (q, max_model_len), which is what the
  Triton backend is allowed to read (attention/triton_backend.py);
- logits are computed for all T rows inside the graph into a static buffer; the sampler picks its rows from it.

Steps with a prefill chunk longer than q run eagerly. Graphs share one memory pool and are captured largest first;
their outputs are copied into buffers allocated before capture, so no graph's output lives in pool memory another
graph reuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dspark.attention.base import AttentionBackend, AttentionContext, AttentionMetadata, KVCache
from dspark.models.llama import CausalLM
from dspark.utils.capture import capture_sizes
from dspark.utils.progress import track


class TableRows:
    """The block tables of a replay's requests, staged into a host array row by row, rewriting of each row only what
    changed since the last replay: a row whose request (its block list, the very object) is the one staged there last
    time, with no more blocks read, is left as it is; one that reads more gets the new columns only.

    NOTE: sound because a request's block list only grows, by append, while the request holds its blocks (freeing it
    replaces the list, kv_cache.free_request); the staged lists are held here, so a freed one's identity cannot pass
    to a new list. Rewriting every row (a numpy slice assignment per row) would cost several times more host time, in
    a step the host bounds at high load."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = host  # [rows, max_blocks]
        self._lists: list[list[int] | None] = [None] * host.shape[0]
        self._widths = [0] * host.shape[0]

    def stage(self, tables: list[list[int]], widths: list[int]) -> None:
        """Row i of the host array holds tables[i][:widths[i]] (columns past it are not read)."""
        host, lists, staged = self.host, self._lists, self._widths
        for i, (b, w) in enumerate(zip(tables, widths, strict=True)):
            start = 0
            if lists[i] is b:
                start = staged[i]
                if start >= w:
                    continue
            else:
                lists[i] = b
            host[i, start:w] = b[start:w]
            staged[i] = w


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    num_tokens: int
    num_reqs: int


class GraphRunner:
    def __init__(
        self,
        model: CausalLM,
        caches: list[KVCache],
        backend_factory: Callable[[], AttentionBackend],
        max_num_seqs: int,
        max_tokens: int,
        query_lens: tuple[int, ...],  # the promised longest queries graphs are captured for (1, and K + 1 with spec)
        max_model_len: int,
        block_size: int,
        tap_layers: tuple[int, ...],
        device: torch.device,
        # The drafter's context write of every row (taps, positions, slots), captured with the target's forward on a
        # side stream (see _forward).
        context_writer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        self.model, self.caches, self.device = model, caches, device
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.tap_layers = tap_layers
        self.query_lens = tuple(sorted(set(query_lens)))
        # A graph for query length q holds at most max_num_seqs * q tokens: no step needs more.
        self.sizes = {q: capture_sizes(min(max_tokens, max_num_seqs * q)) for q in self.query_lens}
        max_t = max(s[-1] for s in self.sizes.values())
        max_r = min(max_t, max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        cfg = model.config
        pin = {"pin_memory": True}
        # Host staging (pinned) and device buffers, one per input; filled every replay, never reallocated.
        self.h_ids = torch.zeros(max_t, dtype=torch.int64, **pin)
        self.h_pos = torch.zeros(max_t, dtype=torch.int64, **pin)
        self.h_slots = torch.full((max_t,), -1, dtype=torch.int64, **pin)
        self.h_qsl = torch.zeros(max_r + 1, dtype=torch.int32, **pin)
        self.h_lens = torch.zeros(max_r, dtype=torch.int32, **pin)
        self.h_tables = torch.zeros(max_r, self.max_blocks, dtype=torch.int32, **pin)
        self.table_rows = TableRows(self.h_tables.numpy())
        self.ids = torch.zeros(max_t, dtype=torch.int64, device=device)
        self.pos = torch.zeros(max_t, dtype=torch.int64, device=device)
        self.slots = torch.full((max_t,), -1, dtype=torch.int64, device=device)
        self.qsl = torch.zeros(max_r + 1, dtype=torch.int32, device=device)
        self.lens = torch.zeros(max_r, dtype=torch.int32, device=device)
        self.tables = torch.zeros(max_r, self.max_blocks, dtype=torch.int32, device=device)
        self.logits = torch.zeros(max_t, cfg.vocab_size, dtype=torch.float32, device=device)
        n_taps = len(tap_layers)
        self.taps = torch.zeros(max_t, n_taps * cfg.hidden_size, dtype=model.lm_head.weight.dtype, device=device)
        self.backend_factory = backend_factory
        self.context_writer = context_writer
        # The context write runs on its own stream, forked as soon as the last tapped layer is done and joined at the
        # end of the step, so that it overlaps the layers after it and the logits instead of following them.
        self._side = torch.cuda.Stream(device) if context_writer is not None else None
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.num_replays = 0
        self._copied: torch.cuda.Event | None = None

    # ---- capture --------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        shapes = [(q, t) for q in reversed(self.query_lens) for t in reversed(self.sizes[q])]
        with torch.cuda.stream(stream):
            for q, t in track(shapes, "capturing CUDA graphs", unit="graph"):
                r = min(t, self.max_num_seqs)
                self._warmup_inputs(t, r, q)
                backend = self.backend_factory()
                self.forward_static(backend, t, r, q)  # warm-up: compiles kernels, creates handles
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.forward_static(backend, t, r, q)
                self.graphs[t, q] = _Graph(graph, t, r)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def _warmup_inputs(self, t: int, r: int, q: int) -> None:
        """A valid batch of this shape that writes nothing: r requests of up to q tokens, all slots -1."""
        per_req = np.minimum(np.maximum(t - np.arange(r) * q, 0), q)
        qsl = np.concatenate([[0], np.cumsum(per_req)]).astype(np.int32)
        self.qsl[: r + 1].copy_(torch.from_numpy(qsl))
        self.lens[:r].copy_(torch.from_numpy(per_req.astype(np.int32)))
        self.slots[:t].fill_(-1)
        self.ids[:t].zero_()
        self.pos[:t].zero_()
        self.tables[:r].zero_()

    def forward_static(self, backend: AttentionBackend, t: int, r: int, q: int) -> None:
        """The target's forward over the static buffers' first t tokens and r request slots (logits and taps into
        theirs; the drafter's context write in a side stream): what every graph replays."""
        cfg = self.model.config
        meta = AttentionMetadata(
            num_actual_tokens=t,  # an upper bound; the Triton backend reads padding from slot -1 and query_start_loc
            slot_mapping=self.slots[:t],
            query_start_loc=self.qsl[: r + 1],
            seq_lens=self.lens[:r],
            block_tables=self.tables[:r],
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            max_query_len=q,
            max_seq_len=self.max_model_len,
        )
        backend.prepare(meta, cfg.num_kv_heads, cfg.num_heads, self.block_size)
        ctx = AttentionContext(backend, meta, self.caches)
        writer, side = self.context_writer, self._side
        if writer is None or side is None or not self.tap_layers:
            hidden, taps = self.model.forward_with_taps(self.ids[:t], self.pos[:t], ctx, self.tap_layers)
            self.logits[:t].copy_(self.model.compute_logits(hidden))
            if taps is not None:
                self.taps[:t].copy_(taps)
            return
        main = torch.cuda.current_stream(self.device)
        held: list[list[torch.Tensor]] = []

        def write(taps: list[torch.Tensor]) -> None:
            # The taps are consumed here (nothing reads them after the replay). They stay referenced (held) until
            # after the join: freed earlier, the allocator could hand their memory to the main stream's later layers
            # while the side stream still reads it.
            held.append(taps)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                writer(torch.cat(taps, dim=-1), self.pos[:t], self.slots[:t])

        hidden, _ = self.model.forward_with_taps(self.ids[:t], self.pos[:t], ctx, self.tap_layers, on_taps=write)
        self.logits[:t].copy_(self.model.compute_logits(hidden))
        main.wait_stream(side)  # joined inside the step (and the graph): the next step starts after the write
        held.clear()

    # ---- replay ---------------------------------------------------------------------------------------------------

    def pick(self, num_tokens: int, num_reqs: int, max_query_len: int) -> tuple[int, int] | None:
        """The key of the smallest graph this step fits, or None (run eagerly)."""
        q = next((q for q in self.query_lens if q >= max_query_len), None)
        if q is None or num_reqs > self.max_num_seqs:
            return None
        t = next((t for t in self.sizes[q] if t >= num_tokens), None)
        return None if t is None else (t, q)

    def replay(
        self,
        key: tuple[int, int],
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        query_start: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        ids_from: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the step; (logits [n, vocab] fp32, taps [n, ...] or None: none when the drafter's context was
        written in the graph), views of static buffers valid until the next replay. ids_from ([n], on the device):
        the input tokens, in place of input_ids (async scheduling: the previous step's samples, not on the host yet)."""
        g = self.graphs[key]
        if self._copied is not None:  # the previous replay's copies out of the staging buffers have run
            self._copied.synchronize()
        n, r = len(input_ids), len(seq_lens)
        t, rr = g.num_tokens, g.num_reqs
        self.h_ids.numpy()[:n] = input_ids
        self.h_ids.numpy()[n:t] = 0
        self.h_pos.numpy()[:n] = positions
        self.h_pos.numpy()[n:t] = 0
        self.h_slots.numpy()[:n] = slots
        self.h_slots.numpy()[n:t] = -1
        self.h_qsl.numpy()[: r + 1] = query_start
        self.h_qsl.numpy()[r + 1 : rr + 1] = n
        self.h_lens.numpy()[:r] = seq_lens
        self.h_lens.numpy()[r:rr] = 0
        # Only the blocks a request's keys occupy are read; its table may hold more (lookahead slots for drafts).
        widths = [-(-length // self.block_size) for length in seq_lens]
        self.table_rows.stage(tables, widths)
        width = max(widths)
        self.ids[:t].copy_(self.h_ids[:t], non_blocking=True)
        if ids_from is not None:
            self.ids[:n].copy_(ids_from)
        self.pos[:t].copy_(self.h_pos[:t], non_blocking=True)
        self.slots[:t].copy_(self.h_slots[:t], non_blocking=True)
        self.qsl[: rr + 1].copy_(self.h_qsl[: rr + 1], non_blocking=True)
        self.lens[:rr].copy_(self.h_lens[:rr], non_blocking=True)
        # Only the first `width` columns of the real rows are ever read (keys past seq_len are not).
        self.tables[:r, :width].copy_(self.h_tables[:r, :width], non_blocking=True)
        # NOTE: the next replay rewrites the pinned staging buffers only after these copies ran (a step without
        # sampling downloads nothing, so the runner's own wait does not cover it); usually long done by then.
        self._copied = torch.cuda.Event()
        self._copied.record()
        g.graph.replay()
        self.num_replays += 1
        # With a context writer the taps were consumed inside the graph and the buffer is not filled.
        taps = self.taps[:n] if self.tap_layers and self.context_writer is None else None
        return self.logits[:n], taps
