"""OutputProcessor: the core's token ids become what callers read. Detokenization, stop strings, logprobs with their
decoded tokens, and RequestOutput in vLLM's three kinds (cumulative, delta, final_only).

A stop string, or a fault while a request's output is processed (its detokenizer raising, say), ends the request here:
process() says which, with how many of the tokens the core sent it dropped, and the engine tells the core to stop
them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from dspark.config import SamplingParams
from dspark.engine.detokenizer import IncrementalDetokenizer
from dspark.engine.messages import EngineCoreOutput, TokenLogprobs
from dspark.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

logger = logging.getLogger("dspark")


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)  # output tokens so far
    text: str = ""  # visible text so far (stop strings cut it)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    margin: int = 0  # SamplingParams.stop_text_margin, once (a property: a call per output otherwise)
    # No text is read before the end (final_only, no stop strings, no logprobs): the core sends its tokens at the end.
    deferred: bool = False
    last: EngineCoreOutput | None = None  # the core's latest counters for this request
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class Processed:
    outputs: list[RequestOutput]
    # Requests this processing ended (stop strings, faults) with how many of the tokens just sent it dropped: the
    # core must stop them.
    stopped: list[tuple[str, int]]


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.stats = {"num_requests_finished": 0, "num_requests_aborted": 0, "num_requests_failed": 0}
        self._decoded: dict[int, str] = {}  # token id -> its text alone (logprobs' decoded_token)
        self.ending_ms = 0.0  # host time spent ending requests since the last take_ending_ms()

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        state = RequestState(request_id, prompt, prompt_token_ids, params, detok, arrival_time)
        state.margin = params.stop_text_margin
        state.deferred = params.output_kind == "final_only" and not params.stop and params.logprobs is None
        if params.logprobs is not None:
            state.logprobs = []
        self.states[request_id] = state

    def abort(self, request_ids: list[str]) -> list[str]:
        """Forget these requests; returns those that were unfinished."""
        aborted = [rid for rid in request_ids if self.states.pop(rid, None) is not None]
        self.stats["num_requests_aborted"] += len(aborted)
        return aborted

    def take_ending_ms(self) -> float:
        ms, self.ending_ms = self.ending_ms, 0.0
        return ms

    def process(self, core_outputs: list[EngineCoreOutput]) -> Processed:
        done = Processed([], [])
        states = self.states
        for out in core_outputs:
            state = states.get(out.request_id)
            if state is None:  # aborted since
                continue
            if out.first_scheduled_time is not None:  # a full output (a plain one leaves the counters as they were)
                state.last = out
            num_before = len(state.token_ids)
            try:
                if out.prompt_logprobs is not None:
                    prompt = state.prompt_token_ids
                    entries = [self._entry(t, row) for t, row in zip(prompt[1:], out.prompt_logprobs, strict=True)]
                    state.prompt_logprobs = [None, *entries]
                num_dropped = self._update(state, out)
            except Exception:
                # A fault in one request's output fails that request alone: the batch's others already have their
                # tokens and go on. It keeps the tokens taken in before the fault, the faulty one included.
                logger.exception("request %s failed while its output was processed", out.request_id)
                done.outputs.append(self._end(state, "error"))
                self.stats["num_requests_failed"] += 1
                done.stopped.append((out.request_id, len(out.new_token_ids) - (len(state.token_ids) - num_before)))
                continue
            if num_dropped is not None:  # ended here, by a stop string, while the core may still run it
                done.stopped.append((out.request_id, num_dropped))
            if state.finish_reason is not None:
                done.outputs.append(self._end(state, state.finish_reason))
                self.stats["num_requests_finished"] += 1
            elif state.params.output_kind != "final_only":
                done.outputs.append(self._output(state, finished=False))
        return done

    def _update(self, state: RequestState, out: EngineCoreOutput) -> int | None:
        """Take in the new tokens in order; a stop string ends the request at the token that completes it. Returns how
        many of the new tokens a stop string dropped (None: no stop string ended it)."""
        p = state.params
        tokens = out.new_token_ids
        # The token that ended the request in the core (EOS, a stop token id) is not shown unless asked for, as vLLM.
        hide_last = out.finish_reason == "stop" and not p.include_stop_str_in_output
        if state.deferred:  # no text is read before the end: decoded once, then
            state.token_ids += tokens
            if out.finish_reason is not None:
                state.text += state.detok.add_all(tokens[:-1] if hide_last and tokens else tokens)
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            return None
        num_out = len(state.token_ids)
        last = len(tokens) - 1
        for i, token in enumerate(tokens):
            state.token_ids.append(token)
            num_out += 1
            if out.new_logprobs is not None and state.logprobs is not None:
                self._add_logprobs(state, token, out.new_logprobs[i])
            if i == last and hide_last:
                break
            delta = state.detok.add([token])
            state.text += delta
            if delta and p.stop and num_out >= p.min_tokens and self._stop_string(state, len(delta)):
                state.finish_reason = "stop"
                return last - i
        if out.finish_reason is not None:
            state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
        return None

    def _add_logprobs(self, state: RequestState, token: int, row: TokenLogprobs) -> None:
        assert state.logprobs is not None
        state.logprobs.append(self._entry(token, row))
        state.cumulative_logprob += row[0]

    def _entry(self, token: int, row: TokenLogprobs) -> dict[int, Logprob]:
        """{token id: Logprob}: the token (sampled, or the prompt's) first, then the top N."""
        logprob, rank, top = row
        entry = {token: Logprob(logprob, rank)}
        for r, (tid, lp) in enumerate(top, start=1):
            entry.setdefault(tid, Logprob(lp, r))  # the token keeps its own rank (ties: equal)
        decoded = self._decoded
        for tid, lp in entry.items():
            text = decoded.get(tid)
            if text is None:  # a prompt's logprobs ask for thousands: each token id decoded once
                text = decoded[tid] = self.tokenizer.decode([tid])
            lp.decoded_token = text
        return entry

    def _stop_string(self, state: RequestState, delta_len: int) -> bool:
        """Whether the text's new part completes a stop string; if so, cut the text there and keep the string."""
        p = state.params
        text = state.text
        best: tuple[int, str] | None = None
        for stop in p.stop:
            start = max(0, len(text) - delta_len - len(stop) + 1)
            idx = text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        state.text = text[: idx + len(stop)] if p.include_stop_str_in_output else text[:idx]
        state.stop_reason = stop
        return True

    def _end(self, state: RequestState, reason: str) -> RequestOutput:
        """The request's final output; it is forgotten."""
        start = time.perf_counter()
        try:
            state.finish_reason = reason
            del self.states[state.request_id]
            return self._output(state, finished=True)
        finally:
            self.ending_ms += (time.perf_counter() - start) * 1e3

    def _output(self, state: RequestState, finished: bool) -> RequestOutput:
        p = state.params
        # While a stop string could still be completing, hold back its possible beginning from the stream.
        visible = len(state.text) if finished else max(0, len(state.text) - state.margin)
        visible = max(visible, state.num_sent_chars)
        new_text = state.text[state.num_sent_chars : visible]
        num_sent = state.num_sent_tokens
        new_ids = state.token_ids[num_sent:]
        state.num_sent_chars, state.num_sent_tokens = visible, num_sent + len(new_ids)
        logprobs = state.logprobs
        if p.output_kind == "delta":  # what this output adds, not all so far: no copy of the whole output a step
            text, output_ids = new_text, new_ids
            logprobs = logprobs[num_sent:] if logprobs is not None else None
        else:
            text = state.text
            output_ids = list(state.token_ids)  # a copy per output (the list grows; callers keep it)
            logprobs = list(logprobs) if logprobs is not None else None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=output_ids,
            cumulative_logprob=state.cumulative_logprob if p.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=state.finish_reason if finished else None,
            stop_reason=state.stop_reason if finished else None,
        )
        last = state.last
        metrics = RequestMetrics(
            arrival_time=state.arrival_time,
            first_scheduled_time=last.first_scheduled_time if last is not None else None,
            first_token_time=last.first_token_time if last is not None else None,
            finished_time=(last.finished_time or time.monotonic()) if finished and last is not None else None,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_cached_tokens=last.num_cached_tokens if last is not None else 0,
            num_generation_tokens=len(state.token_ids),
            num_preemptions=last.num_preemptions if last is not None else 0,
            spec_num_drafts=last.spec_num_drafts if last is not None else 0,
            spec_num_draft_tokens=last.spec_num_draft_tokens if last is not None else 0,
            spec_num_accepted_tokens=last.spec_num_accepted_tokens if last is not None else 0,
        )
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            [completion],
            finished,
            metrics,
            new_text,
            new_ids,
            state.prompt_logprobs,
        )
