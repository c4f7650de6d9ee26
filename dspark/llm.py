"""LLM: offline generate() and chat() over the engine, shaped like vLLM's so scripts can switch by an import."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.llm_engine import LLMEngine
from dspark.errors import ConfigError
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
        **kwargs: Any,
    ) -> None:
        """Arguments as vLLM's LLM (the rest go to EngineConfig). cost_model: the step-cost curves adaptive verification
        plans with (speculative/cost_model.py); None: profiled at start-up, or loaded from the cache."""
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
        self.engine = LLMEngine(config, cost_model)
        self.tokenizer = self.engine.tokenizer

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
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(p, sp))
        except BaseException:
            self.engine.abort_request(ids)  # all or nothing: no half-added batch runs in a later call
            raise
        return self._run(ids, use_tqdm)

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
            raise ConfigError("model", self.engine.config.model, "has no chat template; use generate() with text")
        ids = self.tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in final])
            raise
        finally:
            bar.close()
        return [final[i] for i in ids]

    def get_metrics(self) -> dict[str, Any]:
        return self.engine.get_metrics()
