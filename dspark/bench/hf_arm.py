"""The `hf` arm of `dspark bench sweep`: Hugging Face transformers' continuous batching on the sweep's prompts.

The model is bench throughput's build_hf_model: the engine's family and shape holding exactly the engine's weights, in
its dtype. Each row gets a fresh ContinuousBatchingManager (`model.init_continuous_batching`, then `add_request` /
`get_result`; the same calls in transformers 5.17 and 5.24), so it starts with a cold cache as dspark's rows do:
- concurrency C: at most C requests in flight, kept here as run_row keeps them for dspark (C submitted, another
  whenever one finishes), and transformers is told the same: max_requests_per_batch = C, a paged cache of
  C x (blocks of the longest prompt + output_len, plus one) blocks, so nothing waits for cache, and max_batch_tokens =
  the engine's max_num_batched_tokens (at least C). Block sharing (transformers' prefix cache) follows the engine's
  enable_prefix_caching;
- every request generates exactly output_len tokens (EOS is -1, a token that never comes);
- temperature 0 is argmax; T > 0 samples softmax(logits / T) with no top-k or top-p, from one generator seeded 0 for
  the batch (transformers has no seed per request, so sampled tokens differ from dspark's);
- attention: transformers' own choice for continuous batching, recorded in the JSON: a flash-attention kernel when
  one is installed, else SDPA over the paged cache ('sdpa' in 5.24, 'paged|sdpa' in 5.17).
"""

from __future__ import annotations

import inspect
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from tqdm import tqdm

from dspark.bench.rounds import Round
from dspark.errors import ConfigError

NAME = "hf"
NEVER = -1  # the EOS id given to transformers: no token has it, so every request runs to output_len
CB_FIELDS = ("num_blocks", "max_batch_tokens", "max_requests_per_batch", "allow_block_sharing", "seed")


def require_continuous_batching() -> None:
    """ConfigError unless the installed transformers has the continuous batching API this arm calls."""
    import transformers

    need = f"transformers with continuous batching (5.17 or later); this is transformers {transformers.__version__}"
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        raise ConfigError(NAME, True, f"{need}, without ContinuousBatchingConfig") from None
    if not hasattr(transformers.GenerationMixin, "init_continuous_batching"):
        raise ConfigError(NAME, True, f"{need}, without init_continuous_batching")
    missing = set(CB_FIELDS) - set(inspect.signature(ContinuousBatchingConfig).parameters)
    if missing:
        raise ConfigError(NAME, True, f"{need}, whose ContinuousBatchingConfig lacks {', '.join(sorted(missing))}")


class HFArm:
    """transformers' continuous batching over a copy of the engine's weights. The copy waits on the CPU between the
    arm's rows: the next round's engines size their KV caches from the device memory left free."""

    def __init__(self, model: Any, device: torch.device, max_batch_tokens: int, block_sharing: bool) -> None:
        self.model = model
        self.device = device
        self.max_batch_tokens = max_batch_tokens  # at least the concurrency, per row
        self.block_sharing = block_sharing
        self.attn_implementation: str | None = None  # what transformers ran: known once a row has run
        self.num_blocks: dict[int, int] = {}  # concurrency -> cache blocks of its rows

    @contextmanager
    def on_device(self) -> Iterator[None]:
        self.model.to(self.device)
        try:
            yield
        finally:
            self.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def settings(self, concurrencies: list[int]) -> dict[str, Any]:
        """What --output-json records of the arm."""
        import transformers

        return {
            "transformers_version": transformers.__version__,
            "api": "init_continuous_batching + add_request / get_result, one manager per row",
            "attn_implementation": self.attn_implementation,
            "concurrencies": concurrencies,
            "max_requests_per_batch": "the row's concurrency",
            "max_batch_tokens": {str(c): max(self.max_batch_tokens, c) for c in concurrencies},
            "num_blocks": {str(c): n for c, n in sorted(self.num_blocks.items())},
            "allow_block_sharing": self.block_sharing,
            "seed": 0,
        }

    def warm_up(self, prompt_ids: list[int], temperature: float, num_tokens: int) -> None:
        """One short request through a manager of its own: first-use costs are paid before the rows."""
        self._run([prompt_ids], temperature, num_tokens, 1, f"{NAME} warm-up")

    def run_row(
        self, prompt_ids: list[list[int]], temperature: float, output_len: int, concurrency: int, label: str
    ) -> tuple[Round, list[list[int]]]:
        """The prompts through transformers with at most `concurrency` in flight; the round and the outputs in order."""
        max_len = max(len(p) for p in prompt_ids) + output_len
        self.num_blocks[concurrency] = _num_blocks(concurrency, max_len)
        return self._run(prompt_ids, temperature, output_len, concurrency, label)

    def _run(
        self, prompt_ids: list[list[int]], temperature: float, output_len: int, concurrency: int, label: str
    ) -> tuple[Round, list[list[int]]]:
        max_len = max(len(p) for p in prompt_ids) + output_len
        bar = tqdm(total=len(prompt_ids) * output_len, desc=label, unit="tok", file=sys.stderr, leave=False)
        ids: list[str] = []
        final: dict[str, Any] = {}  # request id -> transformers' GenerationOutput
        with self._manager(temperature, concurrency, max_len) as manager:

            def submit() -> None:
                i = len(ids)
                request_id = manager.add_request(
                    prompt_ids[i],
                    request_id=str(i),
                    max_new_tokens=output_len,
                    eos_token_id=NEVER,
                    record_timestamps=True,
                )
                if request_id is None:
                    raise RuntimeError(f"{label}: transformers' manager refused request {i}")
                ids.append(request_id)

            start = time.perf_counter()
            while len(ids) < min(concurrency, len(prompt_ids)):
                submit()
            while len(final) < len(prompt_ids):
                out = manager.get_result(timeout=1.0)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError(f"{label}: transformers' generation thread stopped (its log says why)")
                    continue
                if out.error is not None:
                    raise RuntimeError(f"{label}: transformers failed request {out.request_id}: {out.error}")
                if out.is_finished():
                    final[out.request_id] = out
                    bar.update(len(out.generated_tokens))
                    if len(ids) < len(prompt_ids):
                        submit()
            elapsed = time.perf_counter() - start
        bar.close()

        outs = [final[i] for i in ids]
        ttft, tpot, e2el = [], [], []
        for out in outs:
            stamps = out.timestamps  # one per generated token, on created_time's clock (time.perf_counter)
            ttft.append(stamps[0] - out.created_time)
            e2el.append(stamps[-1] - out.created_time)
            if len(stamps) > 1:
                tpot.append((e2el[-1] - ttft[-1]) / (len(stamps) - 1))
        token_ids = [list(out.generated_tokens) for out in outs]
        round_ = Round(
            elapsed,
            sum(len(p) for p in prompt_ids),
            sum(len(t) for t in token_ids),
            min(concurrency, len(prompt_ids)),
            ttft,
            tpot,
            e2el,
            {},  # no engine counters: no drafts, and transformers does not count preemptions
        )
        return round_, token_ids

    @contextmanager
    def _manager(self, temperature: float, concurrency: int, max_len: int) -> Iterator[Any]:
        """A started manager for one row, sized for `concurrency` requests of up to `max_len` tokens; stopped after."""
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        sample = temperature > 0
        generation = GenerationConfig(do_sample=sample, temperature=temperature if sample else None, eos_token_id=NEVER)
        cb = ContinuousBatchingConfig(
            num_blocks=_num_blocks(concurrency, max_len),
            max_batch_tokens=max(self.max_batch_tokens, concurrency),
            max_requests_per_batch=concurrency,
            allow_block_sharing=self.block_sharing,
            seed=0,
        )
        manager = self.model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb)
        self.attn_implementation = self.model.config._attn_implementation  # switched by the manager until stop()
        try:
            manager.warmup()  # captures CUDA graphs where transformers uses them, before the clock starts
            manager.start()
            yield manager
        finally:
            manager.stop(block=True)
            manager.destroy()


def _num_blocks(concurrency: int, max_len: int) -> int:
    """Cache blocks for `concurrency` requests of up to `max_len` tokens, one block more each than their tokens need:
    a request never waits for cache (no dspark row preempts either)."""
    from transformers.generation import ContinuousBatchingConfig

    # Tokens per cache block are page_size in 5.24 and block_size in 5.17 (256 by default in both).
    default = ContinuousBatchingConfig()
    page = getattr(default, "page_size", None) or default.block_size
    return concurrency * (math.ceil(max_len / page) + 1)
