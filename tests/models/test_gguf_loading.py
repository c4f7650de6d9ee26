"""Loading GGUF files and Hugging Face directories gives back exactly the weights of the model they were made from.

Each case starts from a tiny random transformers model, converts it the way llama.cpp's convert_hf_to_gguf.py does
(tensor names from gguf's own name map, Llama Q/K rows permuted into GGML's interleaved RoPE layout, 2-D weights
optionally quantized to Q8_0) and checks that load_model() undoes all of it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from dspark.models.config import ModelConfig
from dspark.models.gguf_file import gguf_config, open_gguf
from dspark.models.loader import load_config, load_model
from dspark.models.registry import resolve_model

CPU = torch.device("cpu")
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB, MAX_POS = 64, 128, 2, 4, 2, 128, 256
ROPE_THETA, RMS_EPS, BOS, EOS = 500000.0, 1e-5, 1, 2

# family -> (config class, model class, gguf arch, extra config kwargs)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, gguf.MODEL_ARCH.LLAMA, {}),
    # Llama with attention biases (q/k/v and o_proj): llama.cpp permutes the q and k biases too.
    "llama_bias": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        gguf.MODEL_ARCH.LLAMA,
        {"attention_bias": True},
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, gguf.MODEL_ARCH.QWEN2, {}),
    # head_dim != hidden / heads, as in real Qwen3 models, so the GGUF needs attention.key_length.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, gguf.MODEL_ARCH.QWEN3, {"head_dim": 32}),
}


def tiny_hf_model(family: str, tied: bool) -> transformers.PreTrainedModel:
    config_cls, model_cls, _, extra = FAMILIES[family]
    cfg = config_cls(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POS,
        rope_theta=ROPE_THETA,
        rms_norm_eps=RMS_EPS,
        tie_word_embeddings=tied,
        bos_token_id=BOS,
        eos_token_id=EOS,
        **extra,
    )
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    # Norm weights start at one and biases at zero: randomise everything so no two tensors can be confused.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> GGML's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: transformers.PreTrainedModel, family: str, path: Path, qtype: gguf.GGMLQuantizationType) -> None:
    """Write `model` as llama.cpp's converter would: metadata, renamed tensors, permuted Llama Q/K, quantized 2-D."""
    _, _, arch, _ = FAMILIES[family]
    cfg = model.config
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if family == "qwen3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(cfg.vocab_size)  # Llama writes llama.vocab_size; Qwen leaves only the token list
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)

    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")  # the converter skips the tied copy; the loader must re-tie
    for name, tensor in state.items():
        data = tensor.numpy().astype(np.float32)
        if arch == gguf.MODEL_ARCH.LLAMA and ".q_proj." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and ".k_proj." in name:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:  # llama.cpp keeps norms and biases in F32
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def expected_config(family: str, tied: bool) -> ModelConfig:
    return ModelConfig(
        family=family.removesuffix("_bias"),
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=32 if family == "qwen3" else HIDDEN // HEADS,
        rms_norm_eps=RMS_EPS,
        rope_theta=ROPE_THETA,
        max_position_embeddings=MAX_POS,
        tie_word_embeddings=tied,
        attention_bias=family in ("qwen2", "llama_bias"),
        qk_norm=family == "qwen3",
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


def assert_same_config(got: ModelConfig, want: ModelConfig) -> None:
    # The epsilon went through float32 in the file; every other field must match exactly.
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(got, rms_norm_eps=want.rms_norm_eps) == want


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == torch.float32, name
        assert g.shape == w.shape, name
        if exact:
            assert torch.equal(g, w), f"{name}: max diff {(g - w).abs().max().item()}"
        else:
            # Q8_0: one fp16 scale per 32 values, scale = absmax / 127, so the error is at most about half a step.
            atol = w.abs().max().item() / 127
            torch.testing.assert_close(g, w, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


CASES = [(family, tied) for family in FAMILIES for tied in (False, True)]


@pytest.mark.parametrize(("family", "tied"), CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0], ids=["f32", "q8_0"])
def test_gguf_round_trip(tmp_path: Path, family: str, tied: bool, qtype: gguf.GGMLQuantizationType) -> None:
    hf = tiny_hf_model(family, tied)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, family, path, qtype)

    assert_same_config(gguf_config(open_gguf(path), path), expected_config(family, tied))

    model = load_model(path, torch.float32, CPU)
    assert_same_weights(model.state_dict(), hf.state_dict(), exact=qtype == gguf.GGMLQuantizationType.F32)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_gguf_llama_q_k_are_stored_permuted(tmp_path: Path) -> None:
    """Guards the round trip above: the file really holds permuted rows, so an un-permute that did nothing fails."""
    hf = tiny_hf_model("llama", tied=False)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, "llama", path, gguf.GGMLQuantizationType.F32)
    stored = {t.name: np.asarray(t.data) for t in open_gguf(path).tensors}
    for gguf_name, hf_name in [("blk.0.attn_q.weight", "q_proj"), ("blk.0.attn_k.weight", "k_proj")]:
        original = hf.state_dict()[f"model.layers.0.self_attn.{hf_name}.weight"].numpy()
        assert stored[gguf_name].shape == original.shape
        assert not np.array_equal(stored[gguf_name], original)
        assert np.array_equal(np.sort(stored[gguf_name], axis=None), np.sort(original, axis=None))


def test_gguf_q8_0_is_lossy_but_close(tmp_path: Path) -> None:
    """Guards the Q8_0 cases: the file really is quantized, so exact equality would be wrong there."""
    hf = tiny_hf_model("qwen2", tied=False)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, "qwen2", path, gguf.GGMLQuantizationType.Q8_0)
    types = {t.name: t.tensor_type for t in open_gguf(path).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_q.bias"] == gguf.GGMLQuantizationType.F32
    got = load_model(path, torch.float32, CPU).state_dict()["model.layers.0.mlp.up_proj.weight"]
    want = hf.state_dict()["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(got, want)


def test_gguf_load_in_bfloat16(tmp_path: Path) -> None:
    hf = tiny_hf_model("llama", tied=True)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, "llama", path, gguf.GGMLQuantizationType.F32)
    model = load_model(path, torch.bfloat16, CPU)
    got = model.state_dict()
    for name, w in hf.state_dict().items():
        assert got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name], w.to(torch.bfloat16)), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize(("family", "tied"), CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def test_hf_directory_round_trip(tmp_path: Path, family: str, tied: bool) -> None:
    hf = tiny_hf_model(family, tied)
    hf.save_pretrained(tmp_path)  # transformers 5 always writes safetensors
    assert list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob("*.bin"))

    assert_same_config(load_config(tmp_path), expected_config(family, tied))

    model = load_model(tmp_path, torch.float32, CPU)
    assert_same_weights(model.state_dict(), hf.state_dict(), exact=True)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_gguf_and_hf_directory_agree(tmp_path: Path) -> None:
    hf = tiny_hf_model("llama", tied=False)
    write_gguf(hf, "llama", tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.F32)
    hf.save_pretrained(tmp_path / "hf")
    from_gguf = load_model(tmp_path / "tiny.gguf", torch.float32, CPU)
    from_dir = load_model(tmp_path / "hf", torch.float32, CPU)
    assert_same_config(from_gguf.config, from_dir.config)
    assert_same_weights(from_gguf.state_dict(), from_dir.state_dict(), exact=True)


@pytest.mark.slow
def test_default_model_config() -> None:
    path = resolve_model("smollm2-135m-instruct")
    cfg = gguf_config(open_gguf(path), path)
    assert cfg.family == "llama"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (576, 30, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size) == (49152, 64, 1536)
    assert cfg.tie_word_embeddings
    assert not cfg.attention_bias and not cfg.qk_norm


def test_conversion_shows_a_bar_of_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tiny_hf_model("llama", tied=True)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, "llama", path, gguf.GGMLQuantizationType.F32)
    monkeypatch.setenv("DSPARK_PROGRESS", "1")
    load_model(path, torch.float32, CPU)
    num_tensors = len(gguf.GGUFReader(path).tensors)
    err = capsys.readouterr().err  # a bar of every tensor (cleared when done: tqdm's leave=False)
    assert "dspark: converting weights" in err and f"/{num_tensors} [" in err
