"""`dspark generate` (complete prompts in one batch) and `dspark chat` (a conversation, answers streamed)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from dspark.cli.common import Formatter, load_llm, tty
from dspark.config import MAX_LOGPROBS, SamplingParams
from dspark.engine.args import add_engine_args, engine_config
from dspark.errors import ConfigError, DSparkError
from dspark.llm import LLM
from dspark.outputs import RequestOutput

# Sampling flags whose values go to SamplingParams unchanged when given (None: keep SamplingParams' default).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "min_tokens",
    "stop",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling (defaults as vLLM's SamplingParams)")
    g.add_argument("--temperature", metavar="T", type=float, help="0 is greedy (default: 1.0)")
    g.add_argument("--top-p", metavar="P", type=float, help="nucleus mass in (0, 1] (default: 1.0)")
    g.add_argument("--top-k", metavar="K", type=int, help="keep the k most likely tokens; -1 or 0: all (default: -1)")
    g.add_argument(
        "--min-p", metavar="P", type=float, help="drop tokens below min_p times the top probability (default: 0)"
    )
    g.add_argument(
        "--max-tokens", metavar="N", type=int, default=256, help="most tokens to generate (default: %(default)s)"
    )
    g.add_argument(
        "--min-tokens", metavar="N", type=int, help="tokens to generate before EOS or a stop may end (default: 0)"
    )
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop at this string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep generating after EOS")
    g.add_argument("--presence-penalty", metavar="X", type=float, help="in [-2, 2] (default: 0)")
    g.add_argument("--frequency-penalty", metavar="X", type=float, help="in [-2, 2] (default: 0)")
    g.add_argument("--repetition-penalty", metavar="X", type=float, help="> 0; 1 is none (default: 1.0)")
    g.add_argument(
        "--logprobs", type=int, metavar="N", help=f"return the top-N logprobs of each token (0-{MAX_LOGPROBS})"
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{k: getattr(args, k) for k in SAMPLING_FIELDS if getattr(args, k) is not None})


# ---- generate -----------------------------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = load_llm(engine_config(args))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=tty(sys.stderr))
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=tty(sys.stderr))
    if args.json:
        print(json.dumps([_completion_json(p, o) for p, o in zip(args.prompt, outputs, strict=True)], indent=2))
        return 0
    for i, (prompt, out) in enumerate(zip(args.prompt, outputs, strict=True)):
        completion = out.outputs[0]
        if len(args.prompt) > 1:
            if i:
                print()
            print(f"### {i + 1}: {_shorten(prompt)}")
        print(completion.text)
        if completion.cumulative_logprob is not None:
            print(f"(cumulative logprob {completion.cumulative_logprob:.4f} over {len(completion.token_ids)} tokens)")
    return 0


def _completion_json(prompt: str, out: RequestOutput) -> dict[str, Any]:
    c = out.outputs[0]
    record: dict[str, Any] = {
        "prompt": prompt,
        "text": c.text,
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }
    if c.logprobs is not None:
        record["cumulative_logprob"] = c.cumulative_logprob
        record["logprobs"] = [
            [
                {"token_id": t, "logprob": lp.logprob, "rank": lp.rank, "token": lp.decoded_token}
                for t, lp in pos.items()
            ]
            for pos in c.logprobs
        ]
    return record


def _shorten(text: str, width: int = 70) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


# ---- chat ---------------------------------------------------------------------------------------------------------


class ChatSession:
    """A conversation over one engine: each answer streams to `out` token by token as the engine produces it."""

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.params = params
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict[str, str]] = []

    def prompt_ids(self) -> list[int]:
        """The templated conversation; the oldest exchanges are dropped while it overflows the context."""
        while True:
            ids = self.llm.apply_chat_template(self.system + self.turns)
            if len(ids) < self.engine.max_model_len or len(self.turns) <= 1:
                return ids
            self.turns = self.turns[2:]

    def answer(self, message: str, out: TextIO) -> str:
        self.turns.append({"role": "user", "content": message})
        try:
            request_id = self.engine.add_request(self.prompt_ids(), self.params)
        except DSparkError:
            self.turns.pop()
            raise
        text = ""
        try:
            while self.engine.has_unfinished_requests():
                for step_out in self.engine.step():
                    out.write(step_out.new_text)
                    out.flush()
                    if step_out.finished:
                        text = step_out.outputs[0].text
        except KeyboardInterrupt:
            # Ctrl-C stops this answer, not the session: forget the unanswered message.
            self.engine.abort_request(request_id)
            self.turns.pop()
            out.write("\n")
            return ""
        out.write("\n")
        out.flush()
        self.turns.append({"role": "assistant", "content": text})
        return text


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    session = ChatSession(load_llm(engine_config(args)), params, args.system)
    if args.once is not None:
        session.answer(args.once, sys.stdout)
        return 0
    interactive = tty(sys.stdin)
    if interactive:
        print(f"dspark chat with {args.model}: /exit or Ctrl-D quits, Ctrl-C stops an answer", file=sys.stderr)
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            break
        if not line:  # EOF on a pipe
            break
        message = line.strip()
        if message in ("/exit", "/quit"):
            break
        if not message:
            continue
        try:
            session.answer(message, sys.stdout)
        except ConfigError as e:  # e.g. one message longer than the context: say so and keep the session
            print(f"error: {e}", file=sys.stderr)
    if interactive:
        print(file=sys.stderr)
    return 0


GENERATE_EPILOG = """\
examples:
  dspark generate --prompt "The capital of France is" --temperature 0 --max-tokens 16
  dspark generate --chat --prompt "Write a haiku about tea." --prompt "What is 17 * 23?" --json
"""
CHAT_EPILOG = """\
examples:
  dspark chat --system "You are a terse assistant." --temperature 0.2
  dspark chat --once "Explain recursion in two sentences." --temperature 0
"""


def add_parser(subparsers: Any) -> None:
    gen = subparsers.add_parser(
        "generate",
        help="complete one or more prompts and print the results",
        description="Complete each --prompt (all in one batch) and print the completions in order.",
        epilog=GENERATE_EPILOG,
        formatter_class=Formatter,
    )
    gen.add_argument("--prompt", action="append", required=True, metavar="TEXT", help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    gen.add_argument("--json", action="store_true", help="print a JSON list: text, token_ids, finish_reason, ...")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = subparsers.add_parser(
        "chat",
        help="talk to the model in the terminal, answers streamed as they are generated",
        description="An interactive chat: type a message, read the streamed answer; the conversation is kept.\n"
        "/exit or end of input (Ctrl-D) quits; Ctrl-C stops the answer being written.",
        epilog=CHAT_EPILOG,
        formatter_class=Formatter,
    )
    chat.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation")
    chat.add_argument("--once", metavar="TEXT", help="answer this one message and exit")
    add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)
