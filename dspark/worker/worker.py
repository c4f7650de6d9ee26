"""Worker: everything on the device. It loads the target (and the DSpark drafter), sizes the KV cache from what the
device has left, and builds the drafter and the model runner (which captures the CUDA graphs)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from dspark.config import EngineConfig
from dspark.errors import ConfigError
from dspark.models.llama import use_fast_cpu_path
from dspark.models.loader import load_model
from dspark.models.registry import SHIPPED_DRAFTERS, resolve_model, shipped_drafter
from dspark.speculative.drafters.base import Drafter, make_drafter
from dspark.speculative.drafters.dspark.drafter import DSparkDrafter
from dspark.speculative.drafters.dspark.model import DSparkModel
from dspark.utils.platform import pick_device, pick_dtype, triton_available
from dspark.worker.model_runner import ModelRunner, kv_bytes_per_block, make_backend

logger = logging.getLogger("dspark")


class Worker:
    # NOTE: built outside inference mode, whatever the caller's: parameters made as inference tensors (an LLM built
    # under torch.inference_mode()) and then fused into one GEMM's weight keep an inference tensor's version counter,
    # which F.linear then cannot read (bf16 on a CPU without native bf16, where the weights stay unpacked).
    @torch.inference_mode(False)
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        if self.device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > 1:
            # With the model on the GPU the host's tensor work is small ([R, K] survivals, sampling rows): a pool of
            # CPU threads per op only adds wake-ups and contention with other processes. OMP_NUM_THREADS wins.
            logger.info("CUDA engine: torch CPU threads %d -> 1 (OMP_NUM_THREADS overrides)", torch.get_num_threads())
            torch.set_num_threads(1)
        self.model = load_model(resolve_model(config.model), self.dtype, self.device)
        if self.device.type == "cuda":  # one GEMM for q/k/v and one for gate/up (the CUDA path's fused kernels)
            self.model.fuse_weights()
            if config.batch_invariant:
                if not triton_available() or config.attention_backend == "torch":
                    raise ConfigError(
                        "batch_invariant",
                        True,
                        "on CUDA it needs Triton and attention_backend auto or triton (its kernels are what make a "
                        "row independent of its batch)",
                    )
                self.model.use_batch_invariant_gemms()
        if self.device.type == "cpu" and not config.batch_invariant:
            use_fast_cpu_path(self.model)
        self.model_config = mcfg = self.model.config
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            limit = mcfg.max_position_embeddings
            raise ConfigError("max_model_len", self.max_model_len, f"at most the model's context length, {limit}")
        self.spec = spec = config.spec
        self.dspark_model = self._load_dspark() if spec is not None and spec.method == "dspark" else None
        if self.dspark_model is not None and self.device.type == "cpu" and not config.batch_invariant:
            use_fast_cpu_path(self.dspark_model)
        if self.dspark_model is not None and self.device.type == "cuda":
            for layer in self.dspark_model.layers:
                layer.fuse_weights()
            self.dspark_model.fuse_context_weights()
        self.num_spec_tokens = self._num_spec_tokens()
        # KV slots past a request's last token that drafting writes (the drafter's block)
        self.num_lookahead_tokens = self.dspark_model.config.block_size if self.dspark_model is not None else 0
        self.num_blocks = config.num_kv_blocks or self._kv_blocks_that_fit()
        if self.num_blocks * config.block_size < self.max_model_len + self.num_lookahead_tokens:
            lookahead = self.num_lookahead_tokens
            raise ConfigError(
                "max_model_len",
                self.max_model_len,
                f"at most the KV cache's {self.num_blocks * config.block_size - lookahead} tokens "
                f"({self.num_blocks} blocks of {config.block_size}"
                + (f", less {lookahead} drafter lookahead slots" if lookahead else "")
                + "); lower max_model_len or give the cache more memory",
            )
        drafter: Drafter | None = None
        if spec is not None:
            drafter = make_drafter(
                spec,
                self.num_spec_tokens,
                self.model,
                self.dspark_model,
                self.num_blocks,
                config.block_size,
                self.device,
                self.dtype,
                # batch-invariant on CPU in that mode too (under rejection sampling its drafts decide what is emitted);
                # on CUDA its kernels stay the default ones
                make_backend(
                    config.attention_backend, self.device, config.batch_invariant and self.device.type != "cuda"
                ),
            )
            if isinstance(drafter, DSparkDrafter):
                drafter.pad_rows = self.device.type == "cuda" or config.batch_invariant
                drafter.defer_context = self.device.type == "cpu" and not config.batch_invariant
        self.runner = ModelRunner(
            config,
            self.model,
            self.device,
            self.dtype,
            self.num_blocks,
            drafter,
            spec.verify_method if spec is not None else "strict",
            self.max_model_len,
            self.num_spec_tokens,
            spec.adaptive_verification_ema_alpha if spec is not None else 0.0,
        )

    def _load_dspark(self) -> DSparkModel:
        from dspark.speculative.drafters.dspark.checkpoint import load_drafter

        return load_drafter(self.drafter_path(), self.model_config, self.dtype, self.device)

    def drafter_path(self) -> Path:
        """The spec's drafter directory, or the one shipped for the target alias when it names none."""
        assert self.spec is not None
        if self.spec.model is not None:
            return resolve_model(self.spec.model)
        shipped = shipped_drafter(self.config.model)
        if shipped is None:
            raise ConfigError(
                "speculative_config.model",
                None,
                f"the 'dspark' method needs a drafter directory for {self.config.model!r} (one ships only for "
                f"{', '.join(SHIPPED_DRAFTERS)}); or use the 'ngram' method",
            )
        return shipped

    def _num_spec_tokens(self) -> int:
        if self.spec is None:
            return 0
        k = self.spec.num_speculative_tokens
        if self.dspark_model is not None:
            block = self.dspark_model.config.block_size
            if k is not None and k > block:
                raise ConfigError(
                    "speculative_config.num_speculative_tokens", k, f"at most the drafter's block size, {block}"
                )
            return k or block
        return k or 4

    def _kv_blocks_that_fit(self) -> int:
        config = self.config
        per_block = kv_bytes_per_block(self.model_config, config.block_size, self.dtype)
        if self.dspark_model is not None:  # the drafter's context cache shares the block tables
            per_block += kv_bytes_per_block(self.dspark_model.config.layer_config, config.block_size, self.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for the largest step's vocabulary-sized tensors: the captured logits and their graph's
            # scratch, the sampler's processed copies and verification's fp64 CDF (about 8 fp32 copies per row), the
            # drafter's distributions (static and returned copies), and CUDA-graph pools.
            vocab_row = self.model_config.vocab_size * 4
            drafts = config.max_num_seqs * self.num_spec_tokens
            reserve = 8 * config.max_num_batched_tokens * vocab_row + 2 * drafts * vocab_row + (2 << 30)
            budget = total * config.gpu_memory_utilization - (total - free) - reserve
        else:
            budget = config.kv_cache_memory_gb * (1 << 30)
        return max(1, int(budget // per_block))
