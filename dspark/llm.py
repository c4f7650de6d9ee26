"""LLM: offline generate() and chat() over the engine, shaped like vLLM's so scripts can switch by an import.

The engine runs in this process (LLMEngine), or with engine_process=True its core runs in a process of its own
(engine/sync_front.py), as vLLM V1's multiprocessing engine core and as `dspark serve` runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.sync_front import SyncCoreFront
from dspark.errors import ConfigError, EngineDeadError
from dspark.outputs import RequestOutput
from dspark.speculative.cost_model import CostModel

Message = dict[str, str]


class LLM:
    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        enforce_eager: bool = False,
        seed: int = 0,
        speculative_config: dict[str, Any] | None = None,
        cost_model: CostModel | None = None,
        engine_process: bool = False,
        **kwargs: Any,
    ) -> None:
        """Arguments as vLLM's LLM (the rest go to EngineConfig). cost_model: the step-cost curves adaptive verification
        plans with (speculative/cost_model.py); None: profiled at start-up, or loaded from the cache.

        engine_process: run the engine core in a process of its own (vLLM V1's multiprocessing), through the client
        and messages of the server's core process; this process keeps tokenization, detokenization and stop strings.
        generate(), chat() and get_metrics() answer as in-process (the same outputs, in the same order; the core's
        counters as of its latest outputs); a refused prompt raises the same ConfigError; a core that fails to start
        or dies raises EngineDeadError with its reason, a failed step EngineError. shutdown() (or `with LLM(...)`)
        stops the core; so do garbage collection and the interpreter's exit. There is no in-process engine then:
        `llm.engine` (its model, scheduler, KV cache, for training, evals and benchmarks) raises AttributeError.
        The core process is spawned: a script guards its entry point with `if __name__ == "__main__":`.
        Default False: the engine runs in this process."""
        config = EngineConfig(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            enforce_eager=enforce_eager,
            seed=seed,
            speculative_config=speculative_config,
            **kwargs,
        )
        self.config = config
        self._engine: LLMEngine | None = None
        self._front: SyncCoreFront | None = None
        if engine_process:
            self._front = SyncCoreFront(config, cost_model)
            self.tokenizer = self._front.tokenizer
        else:
            self._engine = LLMEngine(config, cost_model)
            self.tokenizer = self._engine.tokenizer
        self._closed = False

    @property
    def engine(self) -> LLMEngine:
        """The in-process engine (LLMEngine). There is none with engine_process=True, nor after shutdown()."""
        if self._engine is None:
            if self._front is not None:
                raise AttributeError(
                    "LLM.engine is the in-process engine, and this LLM runs its engine core in another process "
                    "(engine_process=True): use generate(), chat() and get_metrics(), or an LLM made with "
                    "engine_process=False for what needs the engine itself (its model, scheduler, KV cache)"
                )
            raise AttributeError("LLM.engine: this LLM has been shut down (shutdown())")
        return self._engine

    @property
    def engine_process(self) -> bool:
        """Whether the engine core runs in a process of its own."""
        return self._front is not None

    def shutdown(self) -> None:
        """Stop the engine: with engine_process=True, the core process (waiting for it to exit); in-process, the engine
        is let go (its memory is freed once nothing else holds it). Idempotent; generate() raises EngineDeadError
        after it."""
        self._closed = True
        if self._front is not None:
            self._front.shutdown()
        self._engine = None

    close = shutdown

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the prompts' order. A prompt is text or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ConfigError("sampling_params", f"<{len(params)} items>", f"one per prompt ({len(prompts)})")
        # Only final outputs are read here: the engine builds no per-step ones.
        params = [dataclasses.replace(sp, output_kind="final_only") for sp in params]
        engine = self._running_engine()
        if self._front is not None:
            return self._run(engine, self._front.add_requests(prompts, params), use_tqdm)  # all or none, one message
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                ids.append(engine.add_request(p, sp))
        except BaseException:
            engine.abort_request(ids)  # all or nothing: no half-added batch runs in a later call
            raise
        return self._run(engine, ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[Message], add_generation_prompt: bool = True) -> list[int]:
        for i, m in enumerate(conversation):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ConfigError(f"messages[{i}]", m, "a dict with string 'role' and 'content'")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("model", self.config.model, "has no chat template; use generate() with text")
        ids = self.tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _running_engine(self) -> LLMEngine | SyncCoreFront:
        engine = self._front if self._front is not None else self._engine
        if self._closed or engine is None:
            raise EngineDeadError("the engine is not running: this LLM has been shut down (shutdown())")
        return engine

    def _run(self, engine: LLMEngine | SyncCoreFront, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req")
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in final])
            raise
        finally:
            bar.close()
        return [final[i] for i in ids]

    def get_metrics(self) -> dict[str, Any]:
        """The engine's counters (LLMEngine.get_metrics()); with engine_process=True, the core's as of its latest
        outputs."""
        return self._running_engine().get_metrics()
