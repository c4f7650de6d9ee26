"""LLMEngine: vLLM's add_request / step / abort_request over an in-process engine core.

step() is: run the core one step, process its outputs (text, stop strings, RequestOutput), stop in the core what the
processing ended, and let the core time the step. Input checks live in the input processor, shared with the server.
"""

from __future__ import annotations

from typing import Any

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.core import EngineCore
from dspark.engine.input_processor import InputProcessor
from dspark.engine.output_processor import OutputProcessor
from dspark.errors import ConfigError
from dspark.models.registry import resolve_model
from dspark.models.tokenizer import load_tokenizer
from dspark.outputs import RequestOutput
from dspark.speculative.cost_model import CostModel


class LLMEngine:
    def __init__(self, config: EngineConfig, cost_model: CostModel | None = None) -> None:
        """cost_model: the step-cost curves adaptive verification plans with; None: profiled at start-up (or loaded
        from the cache, where this model, drafter, device and grid were profiled before)."""
        self.config = config
        self.tokenizer = load_tokenizer(resolve_model(config.tokenizer or config.model))
        self.core = EngineCore(config, cost_model)
        self.input_processor = InputProcessor(self.tokenizer, self.core.info, config.seed)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.max_model_len = self.core.max_model_len
        self.eos_token_id = self.input_processor.eos_token_id
        self._counter = 0
        self._num_prompt_tokens = 0

    # What callers and tests inspect of the core, reachable from the engine.
    @property
    def device(self) -> Any:
        return self.core.device

    @property
    def dtype(self) -> Any:
        return self.core.dtype

    @property
    def model(self) -> Any:
        return self.core.worker.model

    @property
    def model_config(self) -> Any:
        return self.core.worker.model_config

    @property
    def dspark_model(self) -> Any:
        return self.core.worker.dspark_model

    @property
    def num_spec_tokens(self) -> int:
        return self.core.num_spec_tokens

    @property
    def runner(self) -> Any:
        return self.core.runner

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def kv(self) -> Any:
        return self.core.kv

    @property
    def planner(self) -> Any:
        return self.core.planner

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    @property
    def last_step_kind(self) -> str:
        return self.core.last_step_kind

    # ---- requests -------------------------------------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        if request_id is None:
            request_id = f"req-{self._counter}"
        if request_id in self.output_processor.states:
            raise ConfigError("request_id", request_id, "must be unique among unfinished requests")
        request, text = self.input_processor.process(request_id, prompt, params)
        self._counter += 1
        self.output_processor.add(
            request_id, text, request.prompt_token_ids, request.sampling_params, request.arrival_time
        )
        self.core.add_request(request)
        self._num_prompt_tokens += len(request.prompt_token_ids)
        return request_id

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else request_id
        self.core.abort_requests(self.output_processor.abort(ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.states)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    # ---- the step -------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that produced a token or finished (for output_kind
        "final_only", only for those that finished).

        A fault while one request's output is processed (its detokenizer, say) finishes that request alone, with
        finish_reason "error" and its blocks freed; it is logged with its traceback. A fault of the step itself (the
        model runner, drafting) propagates from here, leaving the requests in flight to the caller, who aborts them;
        the engine then serves new requests."""
        core_outputs = self.core.step()
        done = self.output_processor.process(core_outputs)
        if done.stopped:
            self.core.stop_requests(done.stopped)
        self.core.end_step(self.output_processor.take_ending_ms())
        return done.outputs

    # ---- metrics --------------------------------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, int]:
        return {**self.output_processor.stats, "num_prompt_tokens": self._num_prompt_tokens, **self.core.stats}

    def get_metrics(self) -> dict[str, Any]:
        return {**self.output_processor.stats, "num_prompt_tokens": self._num_prompt_tokens, **self.core.get_metrics()}
