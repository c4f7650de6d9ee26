"""CUDA graphs of the DSpark drafting pass: the block forward, the drafts' logits and the Markov loop.

Drafting a block is a two-layer forward plus k rounds of (Markov correction, softmax, draw): a few hundred small
kernels whatever the batch, so eagerly it costs milliseconds of launches. One graph is captured per padded request
count R (worker/cuda_graphs.py's grid), with every per-step value in a static buffer: anchors, positions, slots,
sequence lengths, block tables, temperatures, greedy flags and the block's uniforms. Padding request slots are empty
(no query tokens, seq_len 0, slot -1: they write nothing and attend to nothing; their drafts are dropped).

With a probabilistic drafter each size has two graphs: one that samples (softmax, inverse CDF, distributions out)
and one for passes whose rows are all greedy, which only takes argmaxes.

The outputs are copied out of the static buffers before they are returned: a request's draft distributions must stay
what its drafts were drawn from until it is verified, which can be after another drafting pass reused the buffers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from dspark.attention.base import AttentionMetadata
from dspark.sample.ops import softmax_temperatures
from dspark.speculative.drafters.dspark.markov import DraftRow, draft_uniforms
from dspark.utils.capture import capture_sizes

if TYPE_CHECKING:
    from dspark.speculative.drafters.dspark.drafter import DSparkDrafter


class DraftGraphs:
    def __init__(self, drafter: DSparkDrafter, max_num_seqs: int, max_model_len: int) -> None:
        self.drafter = drafter
        cfg = drafter.model.config
        self.K, self.k = cfg.block_size, drafter.max_num_tokens
        self.sizes = capture_sizes(max_num_seqs)
        self.max_seq_len = max_model_len + self.K
        max_r, dev = self.sizes[-1], drafter.device
        self.max_blocks = -(-self.max_seq_len // drafter.block_size)
        pin = {"pin_memory": True}
        n = max_r * self.K
        self.h_int = torch.zeros(3 * n + max_r, dtype=torch.int64, **pin)  # positions, slots, anchors... one copy
        self.h_meta = torch.zeros(2 * max_r + 1, dtype=torch.int32, **pin)  # query starts, then seq_lens
        self.h_tables = torch.zeros(max_r, self.max_blocks, dtype=torch.int32, **pin)
        self.h_draw = torch.zeros(max_r, 2 + self.k, dtype=torch.float64, **pin)  # temperature, greedy, uniforms
        self.d_int = torch.zeros_like(self.h_int, device=dev)
        self.d_meta = torch.zeros_like(self.h_meta, device=dev)
        self.tables = torch.zeros_like(self.h_tables, device=dev)
        self.d_draw = torch.zeros_like(self.h_draw, device=dev)
        self.n = n
        # Outputs land in buffers allocated before capture: graph-pool memory is then only scratch, shared by all.
        self.tokens = torch.zeros(max_r, self.k, dtype=torch.int64, device=dev)
        vocab = drafter.target.config.vocab_size
        self.probs = torch.zeros(max_r, self.k, vocab, device=dev) if drafter.sample else None
        self.conf = torch.zeros(max_r, self.k, device=dev) if drafter.model.confidence_head is not None else None
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (padded requests, samples?)
        self.num_replays = 0
        self._copied: torch.cuda.Event | None = None

    def _views(self, r: int) -> tuple[torch.Tensor, ...]:
        n = self.n
        pos, slots = self.d_int[: r * self.K], self.d_int[n : n + r * self.K]
        anchors = self.d_int[2 * n : 2 * n + r]
        qsl, lens = self.d_meta[: r + 1], self.d_meta[self.sizes[-1] + 1 : self.sizes[-1] + 1 + r]
        return pos, slots, anchors, qsl, lens

    def _run(self, backend: object, r: int, sample: bool) -> None:
        pos, slots, anchors, qsl, lens = self._views(r)
        meta = AttentionMetadata(
            num_actual_tokens=r * self.K,
            slot_mapping=slots,
            query_start_loc=qsl,
            seq_lens=lens,
            block_tables=self.tables[:r],
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            max_query_len=self.K,
            max_seq_len=self.max_seq_len,
            causal=False,
        )
        draw = self.d_draw[:r]
        temps, greedy = draw[:, 0].float(), draw[:, 1] > 0.5
        u_all = draw[:, 2:] if sample else None
        tokens, probs, conf = self.drafter.block(backend, meta, anchors, pos, temps, greedy, u_all)  # type: ignore[arg-type]
        self.tokens[:r].copy_(tokens)
        if self.probs is not None and probs is not None and sample:
            self.probs[:r].copy_(probs)
        if self.conf is not None and conf is not None:
            self.conf[:r].copy_(conf)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.drafter.device)
        stream.wait_stream(torch.cuda.current_stream(self.drafter.device))
        backend_type = type(self.drafter.backend)
        with torch.cuda.stream(stream):
            for r in reversed(self.sizes):
                for sample in (True, False) if self.drafter.sample else (False,):
                    self._fill([0] * r, [0] * (r * self.K), [-1] * (r * self.K), [self.K] * r, [[0]] * r, None)
                    backend = backend_type()
                    self._run(backend, r, sample)  # warm-up: compiles, allocates handles
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._run(backend, r, sample)
                    self.graphs[r, sample] = graph
        torch.cuda.current_stream(self.drafter.device).wait_stream(stream)
        torch.cuda.synchronize(self.drafter.device)

    def pick(self, num_reqs: int) -> int | None:
        return next((r for r in self.sizes if r >= num_reqs), None)

    def _fill(
        self,
        anchors: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        rows: list[DraftRow] | None,
        padded: int | None = None,
    ) -> None:
        r, K, n = len(anchors), self.K, self.n
        rr = padded or r
        if self._copied is not None:  # the previous pass's copies out of the staging buffers have run
            self._copied.synchronize()
        h_int, h_meta, h_draw = self.h_int.numpy(), self.h_meta.numpy(), self.h_draw.numpy()
        h_int[: r * K], h_int[r * K : rr * K] = positions, 0
        h_int[n : n + r * K], h_int[n + r * K : n + rr * K] = slots, -1
        h_int[2 * n : 2 * n + r], h_int[2 * n + r : 2 * n + rr] = anchors, 0
        h_meta[: rr + 1] = np.minimum(np.arange(rr + 1), r) * K  # padding slots are empty
        off = self.sizes[-1] + 1
        h_meta[off : off + r], h_meta[off + r : off + rr] = seq_lens, 0
        h_tables = self.h_tables.numpy()
        widths = [-(-s // self.drafter.block_size) for s in seq_lens]
        for i, (b, w) in enumerate(zip(tables, widths, strict=True)):
            h_tables[i, :w] = b[:w]
        h_draw[:rr] = 0.0
        h_draw[:rr, 1] = 1.0  # padding rows draw greedily (and are dropped)
        if rows is not None:
            h_draw[:r, 0] = softmax_temperatures([row.temperature for row in rows])
            h_draw[:r, 1] = [float(row.greedy) for row in rows]
            if self.drafter.sample:
                h_draw[:r, 2:] = draft_uniforms(rows, self.k)
        width = max(widths)
        self.d_int.copy_(self.h_int, non_blocking=True)
        self.d_meta[: off + rr].copy_(self.h_meta[: off + rr], non_blocking=True)
        self.tables[:r, :width].copy_(self.h_tables[:r, :width], non_blocking=True)
        self.d_draw[:rr].copy_(self.h_draw[:rr], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def replay(
        self,
        key: int,
        anchors: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        rows: list[DraftRow],
        sample: bool,  # False: argmax drafts, no distributions (every row greedy, or a greedy drafter)
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(tokens [r, k] on the device, draft distributions [r, k, vocab] or None, confidences [r, k] or None)."""
        r = len(anchors)
        sample = sample and self.drafter.sample
        self._fill(anchors, positions, slots, seq_lens, tables, rows, padded=key)
        self.graphs[key, sample].replay()
        self.num_replays += 1
        probs = self.probs[:r].clone() if self.probs is not None and sample else None
        conf = self.conf[:r].clone() if self.conf is not None else None
        return self.tokens[:r], probs, conf
