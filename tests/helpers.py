"""Test helpers importable from any test module (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

from typing import Any

import torch
import zmq

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.core_proc import StartFailed, output_encoder

FAMILIES = ("llama", "qwen2", "qwen3")


def make_hf_model(family: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny random decoder of the family, in fp32, with SmolLM2's vocabulary size."""
    import transformers

    kwargs: dict[str, object] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "qwen3":
        kwargs["head_dim"] = 32  # Qwen3 decouples head_dim from hidden_size / heads
    kwargs.update(overrides)
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kwargs)).float().eval()
    with torch.no_grad():  # larger weights than the default init, so logits are far from uniform and ties are rare
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return model


class SchedulerHarness:
    """Base of the model-free scheduler harnesses: subclasses set `sched` and `kv` and implement `step`."""

    sched: Any
    kv: Any

    def step(self) -> Any:
        raise NotImplementedError

    def check_blocks(self) -> None:
        """Every block's reference count is exactly the number of running requests holding it."""
        expected = [0] * self.kv.num_blocks
        for r in self.sched.running:
            for b in r.block_ids:
                expected[b] += 1
        for r in self.sched.waiting:
            assert r.block_ids == [] and r.num_computed_tokens == 0
        assert self.kv.ref_count == expected

    def run(self, max_steps: int = 1000) -> list[Any]:
        outs = []
        while self.sched.has_unfinished():
            outs.append(self.step())
            assert len(outs) < max_steps, "no progress"
        return outs


def interpreted_verdicts(request: Any, test_name: str, script: str) -> dict[str, str]:
    """Verdicts ("ok" or the failure) of the selected `name` parameters of test `test_name`, computed in one
    subprocess under the Triton interpreter: TRITON_INTERPRET=1 must be set before triton decorates a kernel, and
    would turn every kernel of this process into an interpreted one. `script` (the test file) run with the case
    names prints their verdicts as JSON on its last line."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    names = [
        item.callspec.params["name"] for item in request.session.items if getattr(item, "originalname", "") == test_name
    ]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        # the repository and tests/ (the script imports this module)
        "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, script, *names], env=env, cwd=repo, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def case_verdicts(run: Any, names: list[str]) -> dict[str, str]:
    """In an interpreter subprocess: run(name) for each case; its verdict, "ok" or the failure's last frames."""
    import traceback

    verdicts = {}
    for name in names:
        try:
            run(name)
            verdicts[name] = "ok"
        except Exception:
            verdicts[name] = traceback.format_exc(limit=-3)
    return verdicts


def patch_triton_interpreter() -> None:
    """Work around three bugs of the Triton 3.6 interpreter (not of the compiled kernels) and one property of its dot
    (interpreter runs only).

    - tl.dot multiplies bfloat16 operands as their raw uint16 bits: widen them to fp32 first (exact).
    - tl.dot is numpy's matmul, whose summation order is the BLAS kernel's: with some BLAS builds (OpenBLAS) a row's
      bits depend on its position in the tile, so a kernel whose tiles never depend on the batch could still fail
      the batch-invariance checks. The dot is summed over K in order instead, one fp32 product and add at a time for
      every element (as the kernels' per-element reduction order is fixed). A chain of `acc = tl.dot(a, b, acc)`
      then becomes one sequential sum over all of K, multiply then add (no FMA), so the interpreter cannot catch a
      kernel whose BLOCK_K depended on the batch; the GPU cases can.
    - with NumPy >= 2.4, a loop bound loaded from memory (a 1-element array) cannot be used by range().
    - fp32 -> bf16 casts truncate (the cast passes no rounding mode, and the interpreter's round-to-nearest does not
      carry into the exponent): round to nearest even instead, as the GPU's cvt.rn.bf16.f32 does. Our kernels ask
      for no other rounding mode.

    The patches stay correct once the bugs are fixed; each is skipped if the interpreter's internals moved (a
    remaining bug then shows as a failing case, not as a wrong pass).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = getattr(getattr(interpreter, "InterpreterBuilder", None), "create_dot", None)
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if create_dot is not None and patch_tensor is not None:

        def widen(x: interpreter.TensorHandle) -> interpreter.TensorHandle:
            if x.dtype.scalar != tl.bfloat16:
                return x
            return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

        def dot(
            self: object,
            a: interpreter.TensorHandle,
            b: interpreter.TensorHandle,
            d: interpreter.TensorHandle,
            *args: object,
        ) -> object:
            a, b = widen(a), widen(b)
            if a.data.dtype != np.float32 or b.data.dtype != np.float32 or d.data.dtype != np.float32:
                return create_dot(self, a, b, d, *args)
            acc = d.data.copy()
            for k in range(a.data.shape[-1]):  # acc += a[:, k] b[k, :], in K order: the same sums for every element
                acc += a.data[..., :, k, None] * b.data[..., None, k, :]
            return interpreter.TensorHandle(acc, d.dtype.scalar)

        def patch_tensor_index(tensor: type, scope: interpreter._LangPatchScope) -> None:
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

        interpreter.InterpreterBuilder.create_dot = dot
        interpreter._patch_lang_tensor = patch_tensor_index

    convert = getattr(interpreter, "_convert_float", None)
    if convert is not None:

        def convert_rne(data: np.ndarray, src: object, dst: object, rounding_mode: object) -> np.ndarray:
            if src != tl.float32 or dst != tl.bfloat16:
                return convert(data, src, dst, rounding_mode)
            bits = np.ascontiguousarray(data).view(np.uint32)
            rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(
                np.uint16
            )
            return np.where(np.isnan(bits.view(np.float32)), np.uint16(0x7FC0), rounded)

        interpreter._convert_float = convert_rne


def run_interpreted(run: Any, names: list[str]) -> dict[str, str]:
    """The interpreter subprocess's side of interpreted_verdicts (a test file run as a script): the interpreter's
    patches, one CPU thread (the shapes are tiny, the machine's cores shared), then run(name)'s verdict per case."""
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    torch.set_num_threads(1)
    return case_verdicts(run, names)


def hold_drafting(engine: Any) -> None:
    """Every step of this LLMEngine drafts: adaptive verification still picks each step's budget, but the regime no
    longer follows measured step times, which for a tiny model on a loaded CI machine are noise and may keep every
    step plain. For tests whose subject is speculation's output."""
    assert engine.planner is not None, "adaptive verification is off: there is no regime to hold"
    engine.planner.regime.held = True


# A mixed workload for batch-invariance tests: prompts of these lengths, greedy and seeded sampled requests.
BATCH_LENGTHS = [3, 9, 17, 31, 40, 64, 80, 100, 127, 150, 190, 220, 260, 300, 333, 380]


def batch_workload(
    seed: int, lengths: list[int], max_tokens: int, vocab: int = 49152
) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    prompts[5] = prompts[-3][:64]  # a shared prefix: the prefix cache serves one from the other
    params = []
    for i in range(len(prompts)):
        if i % 2 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens + i, ignore_eos=True))
        else:
            params.append(
                SamplingParams(
                    temperature=0.8 + 0.05 * i,
                    top_p=0.9 if i % 3 else 1.0,
                    top_k=50 if i % 4 == 1 else -1,
                    min_p=0.02 if i % 5 == 1 else 0.0,
                    repetition_penalty=1.1 if i % 3 == 1 else 1.0,
                    frequency_penalty=0.3 if i % 4 == 3 else 0.0,
                    seed=1000 + i,
                    max_tokens=max_tokens + i,
                    ignore_eos=True,
                )
            )
    return prompts, params


def fail_to_start(config: EngineConfig, input_address: str, output_address: str, parent_pid: int) -> None:
    """A core that says it failed to start, and exits (run_core's way: the message is flushed before the exit)."""
    ctx = zmq.Context()
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(output_address)
    outputs.send(output_encoder.encode(StartFailed("RuntimeError: no device")))
    outputs.close()
    ctx.term()
