"""One request's state as the scheduler and the output processor see it (no tensors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from dspark.config import SamplingParams
from dspark.outputs import Logprob


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
        # NOTE: _value_, not value: Enum.value is a descriptor call, and this is read a few times per request and step
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
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: drafts proposed after the last step, to be verified next (dropped on preemption).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_num_drafts: int = 0  # steps that verified at least one of its drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

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
