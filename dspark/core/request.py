"""One request's state as the scheduler and the output processor see it (no tensors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

from dspark.config import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a fault while processing this request's output (vLLM's FinishReason.ERROR)

    @property
    def finished(self) -> bool:
        # _value_, not value: Enum.value is a descriptor call, and this is read a few times per request and step
        return self._value_ in ("stop", "length", "abort", "error")


@dataclass(eq=False)  # identity, not field-by-field: `in running` and `remove` must not compare token lists
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # effective seed: the user's, or one drawn from the engine's seed
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.monotonic)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | None = None  # the stop token id that ended it
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: drafts proposed after the last step, to be verified next (dropped on preemption).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_num_drafts: int = 0  # steps that verified at least one of its drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # SamplingParams.prompt_logprobs: entries for prompt tokens 1.. as prompt chunks compute them; None once sent
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = field(default_factory=list)
    # What ends it, checked per token: a token of `ends_on` (its EOS unless ignored, its stop token ids) once min_tokens
    # are out, or reaching `end_at` tokens (prompt + max_tokens; the core lowers it to max_model_len).
    ends_on: frozenset[int] = field(init=False)
    end_at: int = field(init=False)
    # The front reads its tokens every step (streams, stop strings, logprobs); else only its final output.
    streams: bool = field(init=False)
    # How the sampler picks its tokens, decided once for its whole life (the runner reads it every step): "greedy"
    # (the raw logits' argmax), "temperature" (a softmax at its temperature alone) or "general" (logits_to_probs).
    sampling_path: Literal["greedy", "temperature", "general"] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        p = self.sampling_params
        eos = () if p.ignore_eos or self.eos_token_id is None else (self.eos_token_id,)
        self.ends_on = frozenset((*eos, *p.stop_token_ids))
        self.end_at = len(self.prompt_token_ids) + p.max_tokens if p.max_tokens is not None else 1 << 62
        self.streams = p.output_kind != "final_only" or bool(p.stop) or p.logprobs is not None
        # A request that may have a stop token banned (min_tokens) takes the general path for good, even once
        # min_tokens are out: it gives the same tokens, and the fast paths never have to check.
        if p.has_penalties or (p.min_tokens > 0 and self.ends_on):
            self.sampling_path = "general"
        elif p.greedy:
            self.sampling_path = "greedy"
        elif p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0:
            self.sampling_path = "temperature"
        else:
            self.sampling_path = "general"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
