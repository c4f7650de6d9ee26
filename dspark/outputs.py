"""What generate() and the engine return, shaped like vLLM's RequestOutput so callers can switch."""

from __future__ import annotations

from dataclasses import dataclass, field

# One token's logprobs, of the raw model distribution: its logprob, its rank (1 + the tokens more likely) and the top N
# as (token id, logprob). Plain data: the core sends them to the front.
TokenLogprobs = tuple[float, int, list[tuple[int, float]]]


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    # "stop" | "length" | "abort" | "error". As vLLM's: "error" says the engine failed this request alone (a fault while
    # processing its output, such as a tokenizer error; the log has the traceback); its text and tokens are what it had
    # produced until then, and the batch's other requests were not affected.
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    # Speculative decoding (vLLM's counting): steps that verified drafts, drafts verified, drafts accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_length(self) -> float | None:
        """Tokens emitted per verification step: 1 + accepted / drafts."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    new_text: str = ""  # text added by this step (for streaming)
    new_token_ids: list[int] = field(default_factory=list)
    # SamplingParams.prompt_logprobs, as vLLM's: one entry per prompt token, None for the first (nothing before it)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
