"""Llama-family decoder (Llama / SmolLM2, Qwen2 with qkv biases, Qwen3 with q/k norms) as plain modules.

Parameter names match Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...), so loading is a name mapping.
The forward takes one flattened batch of tokens; attention goes through the context's backend and paged cache.

Three paths. The torch code below is the reference and the batch-invariant CPU path (tests check it against
transformers, bit for bit across batch sizes). For inference on CUDA with Triton, the norms, rotary and SiLU run as the
fused kernels of models/fused_ops.py, each residual add happens inside the next norm (`decoder_stack`), and after
`fuse_weights()` q/k/v and gate/up are one GEMM each: about ten kernels per layer instead of ~45. The fast CPU path
(`use_fast_cpu_path`) runs the same merged GEMMs through oneDNN's pre-packed weights (models/cpu_gemm.py) and, where
the C kernels of kernels/cpu.py build, the fused path's structure with their norms, rotary and SiLU (otherwise
rotary over q and k at once in torch, and torch's fused SiLU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dspark.attention.base import AttentionContext
from dspark.kernels import cpu as cpu_kernels
from dspark.models import cpu_gemm, fused_ops
from dspark.models.config import ModelConfig
from dspark.models.invariant_gemm import linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cpu_fused = False  # the fast CPU path's C kernels (use_fast_cpu_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops.enabled(x) and x.dim() in (2, 3):
            return fused_ops.rms_norm(x, self.weight, self.eps)
        if self.cpu_fused and x.dim() in (2, 3) and x.dtype == self.weight.dtype and cpu_kernels.supports(x):
            if x.dim() == 3:  # per-head q/k norms: heads as rows (a copy only where x is a strided view)
                return cpu_kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        # NOTE: normalise in fp32 and cast back before the weight, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused path: (self(x + residual), x + residual) in one kernel; x, residual: [num_tokens, dim]."""
        if self.cpu_fused and not x.is_cuda:
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotate-half RoPE (the Hugging Face layout; GGUF's interleaved Llama layout is undone at load)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_positions, head_dim]
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for this step's positions, [num_tokens, 1, head_dim] each: computed once, used by all layers."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def _merge_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) stacking the output rows of `linears`, for one GEMM in place of several.

    The linears' parameters become views of the merged tensors, not copies: no memory is duplicated, and what
    later writes the parameters in place (load_state_dict, an optimiser) writes the merged GEMM's weights too.
    Moving the module (.to) gives the parameters their own storage again; fuse after moving, not before.
    """
    has_bias = {m.bias is not None for m in linears}
    assert len(has_bias) == 1, "all or none of the merged projections must have a bias"
    sizes = [m.out_features for m in linears]
    # Outside inference mode: parameters made of inference tensors could not be updated in place later.
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        for m, part in zip(linears, weight.split(sizes), strict=True):
            m.weight.data = part
        bias = None
        if has_bias == {True}:
            bias = torch.cat([m.bias for m in linears])
            for m, part in zip(linears, bias.split(sizes), strict=True):
                m.bias.data = part
    return weight, bias


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]."""
    cos, sin = rope
    if fused_ops.enabled(x) and x.dim() == 3:
        return fused_ops.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    invariant = False  # GEMMs through models/invariant_gemm.py on the fused path (CausalLM.use_batch_invariant_gemms)

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        # Llama's attention_bias covers o_proj too; Qwen2's covers only q/k/v.
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias and cfg.family == "llama")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5
        # Set by fuse_weights(): [(num_heads + 2 * num_kv_heads) * head_dim, hidden], q rows first, then k, then v.
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        # Set by pack_for_cpu(): qkv_weight and o_proj's weight in oneDNN's layout (plain attributes: .to() must not
        # touch them)
        self.qkv_packed: torch.Tensor | None = None
        self.o_packed: torch.Tensor | None = None
        self.cpu_fused = False  # rotary through kernels/cpu.py (pack_for_cpu, where they build)

    def fuse_weights(self) -> None:
        self.qkv_weight, self.qkv_bias = _merge_linears([self.q_proj, self.k_proj, self.v_proj])

    def pack_for_cpu(self) -> None:
        if self.qkv_weight is None:
            self.fuse_weights()
        self.qkv_packed, self.o_packed = cpu_gemm.pack(self.qkv_weight), cpu_gemm.pack(self.o_proj.weight)
        self.cpu_fused = cpu_kernels.lib() is not None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
        n = x.shape[0]
        if fused_ops.enabled(x):
            return self._forward_fused(x, rope, ctx)
        if self.qkv_packed is not None and self.o_packed is not None and not torch.is_grad_enabled():
            return self._forward_packed(x, rope, ctx)
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        o = ctx.backend.forward(q, k, v, ctx.caches[self.layer_idx], ctx.meta, self.scale)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))

    def _forward_packed(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext
    ) -> torch.Tensor:
        """The fast CPU path: one packed GEMM for q/k/v, rotary over q and k in one go (they sit side by side in its
        output), one for o_proj."""
        assert self.qkv_packed is not None and self.o_packed is not None
        n, nq, nkv = x.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = cpu_gemm.linear(x, self.qkv_packed, self.qkv_bias)
        v = qkv[:, nq + nkv :].view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(qkv[:, :nq].view(n, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, nq : nq + nkv].view(n, self.num_kv_heads, self.head_dim))
            if self.cpu_fused and cpu_kernels.supports(q):
                for normed in (q, k):
                    cpu_kernels.rotary_(normed, *rope)  # in place: the norms' outputs are new, contiguous tensors
            else:
                q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        elif self.cpu_fused and cpu_kernels.supports(qkv):
            qk = qkv[:, : nq + nkv].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
            cpu_kernels.rotary_(qk, *rope)  # in place: the GEMM's output is this step's own
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            qk = apply_rotary(qkv[:, : nq + nkv].view(n, self.num_heads + self.num_kv_heads, self.head_dim), rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = ctx.backend.forward(q, k, v, ctx.caches[self.layer_idx], ctx.meta, self.scale)
        return cpu_gemm.linear(o.reshape(n, nq), self.o_packed, self.o_proj.bias)

    def _forward_fused(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext
    ) -> torch.Tensor:
        n, nq, nkv = x.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_weight is not None:
            # q, k and v stay strided views of the one GEMM's output: the backend reads rows by stride.
            q, k, v = linear(x, self.qkv_weight, self.qkv_bias, self.invariant).split([nq, nkv, nkv], dim=-1)
        else:
            q, k, v = (linear(x, p.weight, p.bias, self.invariant) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(n, self.num_heads, self.head_dim)
        k, v = k.view(n, self.num_kv_heads, self.head_dim), v.view(n, self.num_kv_heads, self.head_dim)
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        fused_ops.rotary_qk(q, k, *rope, norm)  # in place
        o = ctx.backend.forward(q, k, v, ctx.caches[self.layer_idx], ctx.meta, self.scale)
        return linear(o.reshape(n, nq), self.o_proj.weight, self.o_proj.bias, self.invariant)


class MLP(nn.Module):
    invariant = False  # as Attention.invariant

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # [2 * intermediate, hidden], gate rows first
        self.exact_silu = True  # SiLU element by element (batch-invariant mode on CPU); False: torch's fused F.silu
        self.cpu_fused = False  # as Attention.cpu_fused
        self.gate_up_packed: torch.Tensor | None = None  # as Attention.qkv_packed
        self.down_packed: torch.Tensor | None = None

    def fuse_weights(self) -> None:
        self.gate_up_weight = _merge_linears([self.gate_proj, self.up_proj])[0]

    def pack_for_cpu(self) -> None:
        if self.gate_up_weight is None:
            self.fuse_weights()
        self.gate_up_packed, self.down_packed = cpu_gemm.pack(self.gate_up_weight), cpu_gemm.pack(self.down_proj.weight)
        self.exact_silu = False
        self.cpu_fused = cpu_kernels.lib() is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_packed is not None and self.down_packed is not None and not torch.is_grad_enabled():
            gate_up = cpu_gemm.linear(x, self.gate_up_packed, None)
            if self.cpu_fused and cpu_kernels.supports(gate_up):
                return cpu_gemm.linear(cpu_kernels.silu_mul(gate_up), self.down_packed, None)
            gate, up = gate_up.chunk(2, dim=-1)
            return cpu_gemm.linear(F.silu(gate) * up, self.down_packed, None)
        if fused_ops.enabled(x):
            if self.gate_up_weight is not None:
                h = fused_ops.silu_mul(linear(x, self.gate_up_weight, None, self.invariant))
            else:
                gate, up = (linear(x, p.weight, None, self.invariant) for p in (self.gate_proj, self.up_proj))
                h = fused_ops.silu_mul(gate, up)
            return linear(h, self.down_proj.weight, None, self.invariant)
        gate = self.gate_proj(x)
        if not self.exact_silu:
            return self.down_proj(F.silu(gate) * self.up_proj(x))
        # NOTE: batch-invariant mode, not F.silu: with 5+ threads torch splits its vectorised loop mid-row and a row's
        # bits then depend on the batch size; exp and division stay element-wise exact (tests/utils/test_numerics.py).
        return self.down_proj(gate / (1 + torch.exp(-gate)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse_weights(self) -> None:
        """Merge q/k/v and gate/up into one GEMM each on the fused path; explicit, as the engine does it for the models
        it serves (the parameters become views of the merged weights: see _merge_linears)."""
        self.self_attn.fuse_weights()
        self.mlp.fuse_weights()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
        if _fused_structure(self, x):
            mlp_out, residual = self.forward_fused(self.input_layernorm(x), x, rope, ctx)
            return residual + mlp_out
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]: input_layernorm of the layer's input
        residual: torch.Tensor,  # [num_tokens, hidden]: the layer's input
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused path: (MLP output, residual stream before it). Their sum is the layer's output; the caller adds it
        inside the next norm (`RMSNorm.forward_add`)."""
        h, residual = self.post_attention_layernorm.forward_add(self.self_attn(h, rope, ctx), residual)
        return self.mlp(h), residual


def _fused_structure(layer: DecoderLayer, x: torch.Tensor) -> bool:
    """Whether `layer` runs with the residual adds inside the norms: the CUDA path's Triton kernels, or the fast CPU
    path's C kernels (for [num_tokens, hidden] activations of the norms' dtype)."""
    if fused_ops.enabled(x):
        return True
    norm = layer.input_layernorm
    return norm.cpu_fused and x.dim() == 2 and x.dtype == norm.weight.dtype and cpu_kernels.supports(x)


def decoder_stack(
    layers: nn.ModuleList,
    norm: RMSNorm,
    x: torch.Tensor,  # [num_tokens, hidden]: the embedded input
    rope: tuple[torch.Tensor, torch.Tensor],
    ctx: AttentionContext,
    tap_layers: tuple[int, ...] = (),
    on_taps: Callable[[list[torch.Tensor]], None] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:  # norm(last layer's output), raw outputs of layers tap_layers
    """`layers` then `norm`, with the residual adds fused into the norms on the fused path. Any stack of DecoderLayers
    can run through it (a drafter's backbone too). on_taps: called with the taps as soon as the last one exists,
    before the layers after it run (a graph forks the drafter's context write off there)."""
    last_tap = max(tap_layers, default=-1)
    if not layers or not _fused_structure(layers[0], x):
        taps = []
        for i, layer in enumerate(layers):
            x = layer(x, rope, ctx)
            if i in tap_layers:
                taps.append(x)
                if i == last_tap and on_taps is not None:
                    on_taps(taps)
        return norm(x), taps
    # Fused: layer i's output (residual + MLP output) first exists as the sum inside the next norm's kernel, which
    # returns it: that is what a tap of layer i takes.
    taps, residual, mlp_out = [], x, None
    for i, layer in enumerate(layers):
        if mlp_out is None:
            h = layer.input_layernorm(residual)
        else:
            h, residual = layer.input_layernorm.forward_add(mlp_out, residual)
            if i - 1 in tap_layers:
                taps.append(residual)
                if i - 1 == last_tap and on_taps is not None:
                    on_taps(taps)
        mlp_out, residual = layer.forward_fused(h, residual, rope, ctx)
    if mlp_out is None:
        return norm(residual), taps
    out, residual = norm.forward_add(mlp_out, residual)
    if len(layers) - 1 in tap_layers:
        taps.append(residual)
        if on_taps is not None:
            on_taps(taps)
    return out, taps


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole target: `forward` gives final hidden states, `compute_logits` the vocabulary scores."""

    invariant = False  # as Attention.invariant, for the logits

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.lm_head_packed: torch.Tensor | None = None  # as Attention.qkv_packed
        self.lm_head_small: torch.Tensor | None = None  # draft_logits' packed copy, made at its first call
        self._lm_head_small_tried = False

    def fuse_weights(self) -> CausalLM:
        """One GEMM for q/k/v and one for gate/up in every layer on the fused (CUDA) path; state_dict unchanged."""
        for layer in self.model.layers:
            layer.fuse_weights()
        return self

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        ctx: AttentionContext,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.forward_with_taps(input_ids, positions, ctx, ())[0]

    def forward_with_taps(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        ctx: AttentionContext,
        tap_layers: tuple[int, ...],
        on_taps: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [num_tokens, hidden], [num_tokens, len(tap_layers) * hidden]
        """Also return the raw outputs of decoder layers `tap_layers` (0-based), concatenated: a drafter's context.
        With on_taps, they go to it instead (a list, not concatenated), as soon as the last one exists."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary(positions)
        hidden, taps = decoder_stack(self.model.layers, self.model.norm, x, rope, ctx, tap_layers, on_taps)
        return hidden, torch.cat(taps, dim=-1) if taps and on_taps is None else None

    def use_batch_invariant_gemms(self) -> CausalLM:
        """Every GEMM of the fused (CUDA) path, logits included, through the batch-invariant kernel
        (models/invariant_gemm.py): the engine's batch_invariant mode."""
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.invariant = True
        self.invariant = True
        return self

    def compute_logits(self, hidden: torch.Tensor, invariant: bool | None = None) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] fp32. invariant: override the model's setting (a drafter's logits need not be
        batch-invariant: its drafts never change a greedy output)."""
        if self.lm_head_packed is not None and not invariant and not torch.is_grad_enabled():
            return cpu_gemm.linear(hidden, self.lm_head_packed, None).float()
        return linear(hidden, self.lm_head.weight, None, self.invariant if invariant is None else invariant).float()

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] fp32: a drafter's logits through this lm_head. Never the batch-invariant GEMM
        (drafts change no greedy output, only how many are accepted). On the fast CPU path in bf16, a block's few
        rows (n <= 8) go through small_linear, which reads the weight once for all of them; its sums stay fp32."""
        if self.lm_head_packed is not None and hidden.shape[0] <= cpu_kernels.SMALL_LINEAR_ROWS:
            if not self._lm_head_small_tried and hidden.dtype == torch.bfloat16:
                self._lm_head_small_tried = True  # None where the kernel cannot take it: not tried again
                self.lm_head_small = cpu_kernels.small_linear_pack(self.lm_head.weight)  # a copy: ~57 MB by default
            if self.lm_head_small is not None and cpu_kernels.supports(hidden):
                return cpu_kernels.small_linear(hidden, self.lm_head_small)
        return self.compute_logits(hidden, invariant=False)


def use_fast_cpu_path(model: nn.Module) -> None:
    """The fast CPU path for every layer of `model` (a target or a drafter), on its final device and dtype: merged and
    pre-packed GEMMs where oneDNN takes them, torch's fused SiLU. A row's bits may then depend on its batch (oneDNN
    picks kernels by shape), so the batch-invariant mode keeps the reference path instead."""
    for module in model.modules():
        if isinstance(module, (Attention, MLP)) or callable(getattr(module, "pack_for_cpu", None)):
            module.pack_for_cpu()  # a drafter's heads too (the DSpark Markov head)
        elif isinstance(module, RMSNorm):
            module.cpu_fused = cpu_kernels.lib() is not None
        elif isinstance(module, CausalLM):
            module.lm_head_packed = cpu_gemm.pack(module.lm_head.weight)
