"""The async HTTP client that `dspark bench serve` and `dspark eval` drive an OpenAI-compatible server with.

Every request streams (server-sent events with `stream_options.include_usage`), so one code path both measures
latency and collects the text. Time to first token is the arrival of the first chunk that carries text: a chat
stream's opening role-only chunk may be sent before any token exists, so it does not count. Inter-token latency is
the gap between consecutive chunks with text; one chunk can hold several tokens (a step's accepted drafts), as in
`vllm bench serve`. Token counts come from the usage chunk the server sends last; a server that sends none gets its
output counted as one token per text chunk and its prompt as the client's own estimate (if any).

A request that fails (connection refused, an HTTP error status, an error event, a stream cut before `[DONE]`) comes
back as a RequestResult with success=False and the reason; it never raises, so one bad request cannot end a run.
A request may also be told to hang up on purpose after a number of text chunks (`dspark bench load` aborts requests
mid-stream this way); it then comes back with disconnected=True.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import queue
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from tqdm import tqdm

from dspark.errors import ConfigError, DSparkError

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
# One request may legitimately take long (a long generation behind a deep queue): only a hung server should end it.
REQUEST_TIMEOUT_S = 6 * 60 * 60
ERROR_TEXT_CHARS = 300

T = TypeVar("T")

Prompt = str | list[dict[str, str]]  # text for /v1/completions, messages for /v1/chat/completions


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # the server root, e.g. http://127.0.0.1:8000 (no /v1)
    backend: str  # a key of BACKENDS
    path: str  # the route requests go to, e.g. /v1/completions
    model: str
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError("backend", self.backend, f"one of {', '.join(BACKENDS)}")
        if not self.path.startswith("/"):
            raise ConfigError("endpoint", self.path, "a path starting with /, e.g. /v1/completions")

    @property
    def url(self) -> str:
        return self.base_url + self.path

    @property
    def chat(self) -> bool:
        return self.backend == "openai-chat"

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def server_root(base_url: str | None, host: str, port: int) -> str:
    """The server root from --base-url (with or without a trailing /v1, as users write either) or --host/--port."""
    root = (base_url or f"http://{host}:{port}").rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise ConfigError("base_url", base_url, "an http:// or https:// URL, e.g. http://127.0.0.1:8000")
    return root.removesuffix("/v1")


@dataclass
class RequestInput:
    prompt: Prompt
    max_tokens: int
    temperature: float
    prompt_len: int | None = None  # the client's estimate, used only when the server reports no usage
    extra: dict[str, Any] = field(default_factory=dict)  # more body fields: ignore_eos, stop, seed, ...


@dataclass
class RequestResult:
    success: bool = False
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first chunk with text
    itl: list[float] = field(default_factory=list)  # seconds between consecutive chunks with text
    latency: float = 0.0  # seconds from sending to the end of the stream
    error: str = ""
    num_text_chunks: int = 0
    num_logprob_tokens: int = 0  # tokens the chunks' logprobs list (when the request asks for logprobs)
    disconnected: bool = False  # the client hung up on purpose (disconnect_after) before the stream ended


def request_body(endpoint: Endpoint, req: RequestInput) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": endpoint.model,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        **req.extra,
    }
    if endpoint.chat:
        messages = req.prompt if isinstance(req.prompt, list) else [{"role": "user", "content": req.prompt}]
        body["messages"] = messages
    else:
        if not isinstance(req.prompt, str):
            raise ConfigError("backend", endpoint.backend, "openai-chat for prompts given as chat messages")
        body["prompt"] = req.prompt
    return body


async def send_request(
    session: aiohttp.ClientSession, endpoint: Endpoint, req: RequestInput, disconnect_after: int | None = None
) -> RequestResult:
    """One streamed request; never raises for a failure of the server or the network. With `disconnect_after`, the
    client closes the connection once that many chunks with text have arrived (0: as soon as the response starts)."""
    result = RequestResult(prompt_tokens=req.prompt_len or 0)
    body = request_body(endpoint, req)
    sent = time.perf_counter()
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    first_chunk: float | None = None
    last = sent
    done = False
    try:
        async with session.post(endpoint.url, json=body, headers=endpoint.headers) as resp:
            if resp.status != 200:
                text = await resp.text()
                result.error = f"HTTP {resp.status}: {text[:ERROR_TEXT_CHARS]}"
                return result
            if disconnect_after == 0:
                return _hang_up(resp, result, parts)
            async for data, arrived in _sse_data(resp):
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {json.dumps(chunk['error'])[:ERROR_TEXT_CHARS]}"
                    return result
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                choice = choices[0]
                first_chunk = first_chunk or arrived
                text = (choice.get("delta") or {}).get("content") if endpoint.chat else choice.get("text")
                if choice.get("finish_reason") is not None:
                    result.finish_reason = choice["finish_reason"]
                logprobs = choice.get("logprobs") or {}
                # completions list the chunk's tokens under "tokens", chat under "content"
                result.num_logprob_tokens += len(logprobs.get("tokens") or logprobs.get("content") or [])
                if text:
                    result.num_text_chunks += 1
                    if parts:
                        result.itl.append(arrived - last)
                    else:
                        result.ttft = arrived - sent
                    last = arrived
                    parts.append(text)
                    if result.num_text_chunks == disconnect_after:
                        return _hang_up(resp, result, parts)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # ValueError: a chunk that is not JSON
        result.error = f"{type(e).__name__}: {e}"[:ERROR_TEXT_CHARS]
        return result
    result.latency = time.perf_counter() - sent
    result.text = "".join(parts)
    if not parts:  # an answer with no text (EOS first): its first token is the first chunk, or the end
        result.ttft = (first_chunk or sent + result.latency) - sent
    if not done:
        result.error = "the stream ended before [DONE]"
        return result
    if usage is not None:
        result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_tokens)
        result.output_tokens = int(usage.get("completion_tokens") or 0)
    else:
        result.output_tokens = len(parts)
    result.success = True
    return result


def _hang_up(resp: aiohttp.ClientResponse, result: RequestResult, parts: list[str]) -> RequestResult:
    # close(), not release(): the connection must really drop for the server to see its client gone.
    resp.close()
    result.disconnected = True
    result.text = "".join(parts)
    return result


async def _sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, float]]:
    """The `data:` payloads of a server-sent-event stream, each with the time its bytes arrived."""
    buffer = b""
    async for piece in resp.content.iter_any():
        arrived = time.perf_counter()
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            text = line.decode("utf-8").rstrip("\r")
            if text.startswith("data:"):
                yield text[5:].strip(), arrived
    if buffer.startswith(b"data:"):
        yield buffer.decode("utf-8")[5:].strip(), time.perf_counter()


def open_session(max_concurrency: int | None) -> aiohttp.ClientSession:
    # aiohttp's default pool caps connections at 100, which would silently cap concurrency: size it to ours.
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))


async def get_text(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> str:
    async with session.get(url, headers=headers) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise DSparkError(f"GET {url}: HTTP {resp.status}: {text[:ERROR_TEXT_CHARS]}")
        return text


async def first_model(session: aiohttp.ClientSession, root: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models (what --model defaults to)."""
    url = root + "/v1/models"
    try:
        listing = json.loads(await get_text(session, url, auth_headers(api_key)))
        return str(listing["data"][0]["id"])
    except aiohttp.ClientError as e:
        raise DSparkError(f"cannot reach the server at {root} ({type(e).__name__}: {e}); is it running?") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise DSparkError(f"{url} lists no model; pass --model") from None


async def fetch_metrics(session: aiohttp.ClientSession, root: str, api_key: str | None) -> str | None:
    """The server's /metrics text, or None when it has none (then the result has no spec-decode fields)."""
    try:
        return await get_text(session, root + "/metrics", auth_headers(api_key))
    except (aiohttp.ClientError, TimeoutError, DSparkError):
        return None


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """When each request is due, in seconds after the start: all at once for an infinite rate, else a Poisson process
    (exponential gaps of mean 1 / rate) drawn from the seed, the first request at 0."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.expovariate(request_rate)
        offsets.append(t)
    return offsets


@dataclass
class Run:
    results: list[RequestResult]  # in input order
    duration: float  # seconds from the first request due to the last one finished
    max_in_flight: int  # most requests the client had open at once (several workers: the sum of their peaks)
    cpu_s: float = 0.0  # CPU seconds the client spent over the duration (all its processes)


async def run_requests(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    inputs: list[RequestInput],
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    desc: str = "requests",
    progress: bool = True,
    on_done: Callable[[], None] | None = None,
) -> Run:
    """Send every input, each when its arrival time comes and a concurrency slot is free; wait for all. on_done is
    called as each request ends."""
    check_load(max_concurrency, request_rate)
    offsets = arrival_offsets(len(inputs), request_rate, seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(inputs), desc=desc, unit="req", file=sys.stderr, disable=not progress)
    in_flight = max_in_flight = 0
    start, cpu = time.perf_counter(), time.process_time()

    async def one(req: RequestInput) -> RequestResult:
        nonlocal in_flight, max_in_flight
        async with slots:
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                return await send_request(session, endpoint, req)
            finally:
                in_flight -= 1
                bar.update(1)
                if on_done is not None:
                    on_done()

    tasks = []
    for req, offset in zip(inputs, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return Run(list(results), duration, max_in_flight, time.process_time() - cpu)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, on uvloop where it is installed: a streaming client's cost per chunk is mostly its event loop's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def run_in_workers(
    endpoint: Endpoint,
    inputs: list[RequestInput],
    num_workers: int,
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    desc: str = "requests",
    progress: bool = True,
) -> Run:
    """run_requests spread over client processes, for loads one Python process cannot read fast enough (a GPU server
    streaming 10^5 tokens a second, a chunk each). Worker w sends inputs w, w + W, ... with its share of the
    concurrency (the shares add up to max_concurrency) and of the request rate (independent Poisson processes at
    rate / W merge into one at the full rate), from seed + w. They start together; the duration runs from the first
    worker's start to the last one's end (perf_counter is the system's monotonic clock, shared by processes)."""
    if num_workers < 1:
        raise ConfigError("num_workers", num_workers, "a positive integer")
    check_load(max_concurrency, request_rate)
    workers = min(num_workers, len(inputs), max_concurrency or num_workers)
    caps = [
        None if max_concurrency is None else max_concurrency // workers + (w < max_concurrency % workers)
        for w in range(workers)
    ]
    ctx = multiprocessing.get_context("spawn")  # the caller may hold threads (tqdm, a server's loop)
    start = ctx.Barrier(workers + 1)
    done = ctx.Value("i", 0)
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(endpoint, inputs[w::workers], caps[w], request_rate / workers, seed + w, start, done, results, w),
            name=f"dspark-client-{w}",
            daemon=True,
        )
        for w in range(workers)
    ]
    for proc in procs:
        proc.start()
    bar = tqdm(total=len(inputs), desc=desc, unit="req", file=sys.stderr, disable=not progress)
    try:
        try:
            start.wait(timeout=120)
        except threading.BrokenBarrierError:
            raise DSparkError("the client workers did not start within 120 s") from None
        shards: dict[int, tuple[list[RequestResult], float, float, int, float]] = {}
        while len(shards) < workers:
            try:
                w, *shard = results.get(timeout=0.2)
                shards[w] = tuple(shard)  # results, start, end, most in flight, CPU seconds
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise DSparkError(f"client worker {dead[0].name} exited with code {dead[0].exitcode}") from None
            bar.update(done.value - bar.n)
    finally:
        bar.close()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    ordered: list[RequestResult] = [RequestResult()] * len(inputs)
    for w, (shard, *_) in shards.items():
        ordered[w::workers] = shard
    duration = max(s[2] for s in shards.values()) - min(s[1] for s in shards.values())
    return Run(ordered, duration, sum(s[3] for s in shards.values()), sum(s[4] for s in shards.values()))


def _worker(
    endpoint: Endpoint,
    inputs: list[RequestInput],
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    start: Any,
    done: Any,
    results: Any,
    index: int,
) -> None:
    async def main() -> tuple[Run, float]:
        async with open_session(max_concurrency) as session:
            start.wait()
            began = time.perf_counter()
            run = await run_requests(
                session,
                endpoint,
                inputs,
                max_concurrency=max_concurrency,
                request_rate=request_rate,
                seed=seed,
                progress=False,
                on_done=lambda: _increment(done),
            )
            return run, began

    run, began = run_async(main())
    results.put((index, run.results, began, began + run.duration, run.max_in_flight, run.cpu_s))


def _increment(counter: Any) -> None:
    with counter.get_lock():
        counter.value += 1


def check_load(max_concurrency: int | None, request_rate: float) -> None:
    if max_concurrency is not None and max_concurrency < 1:
        raise ConfigError("max_concurrency", max_concurrency, "a positive integer (or leave it out: no limit)")
    if not request_rate > 0:
        raise ConfigError("request_rate", request_rate, "requests per second > 0, or inf: all at once")


# ---- command line -------------------------------------------------------------------------------------------------


def add_server_args(
    parser: argparse.ArgumentParser, *, max_concurrency: int | None = None, concurrency_flag: bool = True
) -> None:
    """The flags that name the server and how to talk to it, shared by `bench serve`, `bench load` and `eval`
    (`bench load` holds a fixed concurrency of its own, so it asks for no --max-concurrency)."""
    g = parser.add_argument_group("server")
    g.add_argument(
        "--backend", choices=list(BACKENDS), default="openai", help="completions or chat API (default: %(default)s)"
    )
    g.add_argument("--base-url", metavar="URL", help="the server root, e.g. http://127.0.0.1:8000 (a /v1 is dropped)")
    g.add_argument("--host", default="127.0.0.1", help="without --base-url (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="without --base-url (default: %(default)s)")
    g.add_argument(
        "--endpoint", metavar="PATH", help="the route (default: /v1/completions, or /v1/chat/completions for chat)"
    )
    g.add_argument("--model", metavar="NAME", help="the model name to send (default: the first in /v1/models)")
    g.add_argument("--api-key", metavar="KEY", help="sent as a bearer token (default: $OPENAI_API_KEY, else none)")
    if concurrency_flag:
        g.add_argument(
            "--max-concurrency",
            metavar="C",
            type=int,
            default=max_concurrency,
            help="most requests in flight at once (default: %s)" % (max_concurrency or "no limit"),
        )
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


async def endpoint_from_args(session: aiohttp.ClientSession, args: argparse.Namespace) -> Endpoint:
    """The Endpoint the flags name; asks the server for its model when --model is not given."""
    root = server_root(args.base_url, args.host, args.port)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    model = args.model or await first_model(session, root, api_key)
    return Endpoint(root, args.backend, args.endpoint or BACKENDS[args.backend], model, api_key)
