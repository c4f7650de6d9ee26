"""What crosses between the engine's front (input and output processing) and its core (the step loop).

Plain data in msgspec structs, as vLLM's EngineCoreRequest / EngineCoreOutput: the core can run in another process
and its messages are encoded as they are. The core speaks token ids only; text (detokenization, stop strings) is the
front's.
"""

from __future__ import annotations

import msgspec

from dspark.config import SamplingParams
from dspark.outputs import TokenLogprobs


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # effective seed: the request's, or one the front drew from the engine's seed
    eos_token_id: int | None
    arrival_time: float


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's news from one step: the tokens it emitted (a request whose text the front needs only at the end
    gets one output, when it finishes, with all its tokens), whether it finished, and its counters.

    A plain output (a continued step's token of a request that goes on) carries the token alone: its counters are
    those of the request's last full output (first_scheduled_time set), which the front keeps. At 256 streams, the
    full ones cost the core ~0.15 ms a step to build."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, where the request asked for logprobs
    finish_reason: str | None = None  # "stop" (EOS or a stop token id), "length"; stop strings are the front's
    stop_reason: int | None = None  # the stop token id that ended it
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    spec_num_drafts: int = 0  # steps that verified its drafts (vLLM's counting)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # SamplingParams.prompt_logprobs: prompt tokens 1.. (the first has none), with the request's first output
    prompt_logprobs: list[TokenLogprobs] | None = None


class EngineCoreInfo(msgspec.Struct, frozen=True):
    """What the front needs to know of the core it talks to, fixed once the core is built."""

    vocab_size: int
    max_model_len: int
    eos_token_id: int | None  # the model's (the tokenizer's wins where it has one)
    num_spec_tokens: int
    device: str
    dtype: str
