"""Writing tiny GGUF files the way llama.cpp's convert_hf_to_gguf.py does, for tests: a random
llama (write_tiny_llama), or any supported architecture from a transformers model
(write_gguf_from_hf)."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch

from pagedllm.model_loader.gguf_tokenizer import bytes_to_unicode

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 256, 2
HEAD_DIM = HIDDEN // HEADS
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Copied from llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute): HF -> GGUF q/k rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama_cpp_rope_freqs(head_dim, base, factor, low, high, old_context_len) -> np.ndarray:
    """Copied from llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def gpt2_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, the 256 byte symbols, a few merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ w", "Ġw o", "r l", "Ġwo rl"]
    merges += ["Ġworl d", "l l", "e ll", "h ell", "hell o", "Ġ hello", "Ġ Ġ", "ĊĊ Ċ", "Ċ Ċ"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + alphabet + merged
    types = [3] * len(specials) + [1] * (len(alphabet) + len(merged))
    return tokens, types, merges


def random_hf_weights(
    vocab_size: int, seed: int = 0, lm_head: bool = False
) -> dict[str, np.ndarray]:
    """HF-layout float32 weights for the tiny llama."""
    g = np.random.default_rng(seed)

    def rand(*shape):
        return g.standard_normal(shape).astype(np.float32) * 0.5

    w = {"model.embed_tokens.weight": rand(vocab_size, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    if lm_head:
        w["lm_head.weight"] = rand(vocab_size, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = rand(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = rand(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = rand(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = rand(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = rand(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = rand(HIDDEN, FFN)
    return w


_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate and up stay fused in ffn_up
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
    "mlp.experts.down_proj": "ffn_down_exps",
}


def gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, i, rest = stem.split(".", 3)
        return f"blk.{i}.{_TO_GGUF[rest]}.{suffix}"
    return f"{_TO_GGUF[stem]}.{suffix}"


def write_tiny_llama(
    path: Path,
    weights: dict[str, np.ndarray],
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    *,
    arch: str = "llama",
    tokenizer: str = "gpt2",
    rope_freqs: np.ndarray | None = None,
    raw_tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
    eot_token_id: int | None = None,
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """Write `weights` (HF names and layout) as llama.cpp would: q/k permuted, 2-D weights in
    `qtype` (norms stay F32, as llama.cpp keeps them), with a tokenizer in the metadata.
    `raw_tensors` (gguf name -> already-encoded bytes, type) replace the matching weights."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    if tokenizer == "gpt2":
        tokens, types, merges = gpt2_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(chat_template)
        if eot_token_id is not None:
            w.add_eot_token_id(eot_token_id)
    raw_tensors = raw_tensors or {}
    for hf_name, array in weights.items():
        name = gguf_name(hf_name)
        if name in raw_tensors:
            data, raw_type = raw_tensors[name]
            w.add_tensor(name, data, raw_dtype=raw_type)
            continue
        if ".attn_q." in name:
            array = llama_cpp_permute(array, HEADS)
        elif ".attn_k." in name:
            array = llama_cpp_permute(array, KV_HEADS)
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(array), qtype)
            w.add_tensor(name, data, raw_dtype=qtype)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# HF model_type -> llama.cpp architecture (Mistral converts to llama).
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "granite": "granite",
    "phi3": "phi3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",  # llama with experts
}
PERMUTED_QK = ("llama", "granite")  # llama.cpp's "normal" RoPE archs; the others are NEOX


def write_gguf_from_hf(
    path: Path,
    hf_model,
    *,
    sliding_window_key: bool = True,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write a transformers model as llama.cpp's converter would (F32, gpt2 tokenizer metadata;
    the model's vocab_size must be len(gpt2_vocab()[0])). `sliding_window_key` writes
    `llama.attention.sliding_window` for a Mistral, which llama.cpp's converter leaves out;
    `extra_tensors` (GGUF name -> array) are added as they are."""
    c = hf_model.config
    arch = GGUF_ARCH[c.model_type]
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    rope = dict(c.rope_parameters)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{c.model_type}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if head_dim != c.hidden_size // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if c.model_type == "granite":
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if c.model_type == "phi3":
        w.add_sliding_window(c.sliding_window or 0)
    if c.model_type in ("qwen3_moe", "mixtral"):
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if c.model_type == "qwen3_moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if c.model_type == "mistral" and sliding_window_key and c.sliding_window is not None:
        w.add_sliding_window(c.sliding_window)
    tokens, types, merges = gpt2_vocab()
    assert c.vocab_size == len(tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(2)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # the converter leaves the tied output out
        array = tensor.detach().float().numpy()
        if hf_name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * ffn, hidden]: split
            block = hf_name.split(".")[2]
            gate, up = np.split(array, 2, axis=1)
            w.add_tensor(f"blk.{block}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(f"blk.{block}.ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        name = gguf_name(hf_name if tensor.dim() < 3 else f"{hf_name}.weight")
        if arch in PERMUTED_QK and ".attn_q." in name:
            array = llama_cpp_permute(array, heads)
        elif arch in PERMUTED_QK and ".attn_k." in name:
            array = llama_cpp_permute(array, kv_heads)
        w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_GEMMA3_TO_GGUF = {
    **_TO_GGUF,
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_gemma3_gguf(path: Path, hf_model, all_keys: bool = False) -> Path:
    """Write a transformers Gemma3ForCausalLM as llama.cpp's converter does (F32): its metadata
    keys, gemma3 tensor names, q/k not permuted, every norm weight stored as 1 + w, and no
    sliding-window pattern, local RoPE base or query_pre_attn_scalar (llama.cpp fixes those: one
    full layer in 6, 10000, head_dim), so `hf_model` must use those values. `all_keys` writes
    those too, with the keys gguf defines for them, and the soft-caps."""
    c = hf_model.config
    rope = c.rope_parameters["full_attention"]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny-gemma3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    w.add_head_count_kv(c.num_key_value_heads)
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if all_keys:
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        w.add_float32(
            gguf.Keys.Rope.FREQ_BASE_SWA.format(arch="gemma3"),
            c.rope_parameters["sliding_attention"]["rope_theta"],
        )
        w.add_attention_scale(c.query_pre_attn_scalar**-0.5)
        if c.attn_logit_softcapping is not None:
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        if c.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        stem = hf_name.removesuffix(".weight")
        if stem.startswith("model.layers."):
            _, _, i, rest = stem.split(".", 3)
            name = f"blk.{i}.{_GEMMA3_TO_GGUF[rest]}.weight"
        else:
            name = f"{_GEMMA3_TO_GGUF[stem]}.weight"
        array = tensor.detach().float().numpy()
        if hf_name.endswith("norm.weight"):
            array = array + 1
        w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def requantize(src: Path, dst: Path, qtype: gguf.GGMLQuantizationType, suffix: str) -> Path:
    """A copy of the F32 GGUF `src` (metadata and tensors) with the tensors whose names end in
    `suffix` quantized to `qtype` by the gguf package, as llama.cpp's quantize tool rewrites
    a file (e.g. gpt-oss's experts in MXFP4)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by the writer itself
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name.endswith(suffix):
            writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
