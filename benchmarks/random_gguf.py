"""`python -m benchmarks.random_gguf`: a GGUF file of a real Llama shape with random weights, for
measuring speed, memory and start-up at real model sizes without downloading a model.

The file is a llama.cpp-style "llama" GGUF: the vocabulary, tokenizer and chat template are
copied from the packaged SmolLM2 GGUF (vocab 49152), tie_word_embeddings (no output.weight;
`--untied` writes one), the token embedding Q8_0, norms F32 (all ones), the projections `--type`
(Q4_1, Q4_0 or Q8_0; or Q4_K_M, llama.cpp's mixture: Q4_K projections, Q6_K for attn_v and
ffn_down in the layers where llama.cpp gives them more bits, and a Q6_K tied embedding, or a Q4_K
embedding and a Q6_K output.weight when untied). The quantized blocks are random codes
with a fixed scale (weights of standard deviation ~0.02, centred), written straight as bytes
tensor by tensor, so memory stays at one tensor even for 8B.
Both pagedllm and llama.cpp's llama-server load it; its text is gibberish. No rope scaling is
written (Llama 3's "llama3" rope factors): the speed and memory are the same.

    python -m benchmarks.random_gguf /tmp/llama-1b-q4_1.gguf --shape llama-1b   # ~0.7 GB
    python -m benchmarks.random_gguf /tmp/llama-8b-q4_1.gguf --shape llama-8b   # ~4.6 GB
    python -m benchmarks.random_gguf /tmp/tiny.gguf --shape tiny --type Q8_0 --num-layers 4
    python -m benchmarks.random_gguf /tmp/llama-1b-untied.gguf --type Q4_K_M --untied
    python -m benchmarks.random_gguf /tmp/moe-a3b.gguf --shape moe-a3b   # Mixtral's layout
    python -m benchmarks.random_gguf /tmp/hybrid-1b.gguf --shape hybrid-1b   # granitehybrid
    python -m benchmarks.random_gguf /tmp/gdn-1b.gguf --shape gdn-1b   # qwen35

llama-1b writes context_length 131072 as Llama 3.2 does; the engine caps it by --max-model-len.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import gguf
import numpy as np

from pagedllm.model_loader import resolve_model

Q = gguf.GGMLQuantizationType
SHAPES = {
    # Llama 3.2 1B
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                     num_kv_heads=8, rope_theta=500000.0, rms_eps=1e-5, context_length=131072),
    # Llama 3 8B
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                     num_kv_heads=8, rope_theta=500000.0, rms_eps=1e-5, context_length=8192),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                 num_kv_heads=2, rope_theta=500000.0, rms_eps=1e-5, context_length=8192),
    # Qwen3-30B-A3B's layer (128 experts of 768, 8 used; 16 heads of 128 for its 32 of 128
    # against a 2048 hidden size), 8 of its 48 layers: 5.0B parameters, 0.7B active.
    "moe-a3b": dict(hidden_size=2048, intermediate_size=6144, num_layers=8, num_heads=16,
                    num_kv_heads=4, rope_theta=1000000.0, rms_eps=1e-6, context_length=40960,
                    num_experts=128, experts_used=8, expert_size=768),
    # A Granite-4.0-H-like hybrid of about 1B: 28 Mamba-2 layers (48 heads of 64, state 128)
    # and 4 attention layers (without RoPE), a dense MLP in every layer.
    "hybrid-1b": dict(hidden_size=1536, intermediate_size=4096, num_layers=32, num_heads=12,
                      num_kv_heads=4, rope_theta=10000.0, rms_eps=1e-5, context_length=131072,
                      attention_layers=(5, 13, 21, 29), mamba_heads=48, mamba_head_dim=64,
                      mamba_state=128, mamba_groups=1, mamba_conv=4),
    # A Qwen3.5-like hybrid of about 1.2B (llama.cpp's qwen35): 3 Gated DeltaNet layers (16 key
    # and 16 value heads of 128) to 1 gated attention layer (8 heads of 256, 2 KV heads, a
    # quarter of each head rotated), a dense MLP in every layer.
    "gdn-1b": dict(hidden_size=2048, intermediate_size=4096, num_layers=24, num_heads=8,
                   num_kv_heads=2, rope_theta=10000000.0, rms_eps=1e-6, context_length=262144,
                   head_dim=256, full_attention_interval=4, linear_heads=16, linear_head_dim=128,
                   linear_conv=4),
    # Its dense twin: one MLP of the 8 used experts' size, the same active parameters.
    "dense-a3b": dict(hidden_size=2048, intermediate_size=6144, num_layers=8, num_heads=16,
                      num_kv_heads=4, rope_theta=1000000.0, rms_eps=1e-6, context_length=40960),
}  # fmt: skip
PROJ_TYPES = {"Q4_1": Q.Q4_1, "Q4_0": Q.Q4_0, "Q8_0": Q.Q8_0, "Q4_K_M": Q.Q4_K}
FILE_TYPES = {
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
}
WEIGHT_STD = 0.02
# A router's weight: F32, random (not ones, which would route every token to the same experts).
ROUTER = "router"
SMALL, NEGATIVE = "small", "negative"  # F32: normal x 0.1; a Mamba layer's A, in -16..-1
CODE_STD = {Q.Q8_0: np.sqrt((256**2 - 1) / 12), Q.Q4_0: np.sqrt((16**2 - 1) / 12)}
CODE_STD[Q.Q4_1] = CODE_STD[Q.Q4_K] = CODE_STD[Q.Q4_0]
CODE_STD[Q.Q6_K] = np.sqrt((64**2 - 1) / 12)


def more_bits(layer: int, num_layers: int) -> bool:
    """The layers whose attn_v and ffn_down llama.cpp's Q4_K_M quantizes to Q6_K."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def head_dim(shape: dict) -> int:
    return shape.get("head_dim") or shape["hidden_size"] // shape["num_heads"]


def is_linear(shape: dict, layer: int) -> bool:
    """A Gated DeltaNet layer of a qwen35 shape: all but every full_attention_interval-th."""
    interval = shape.get("full_attention_interval")
    return bool(interval) and (layer + 1) % interval != 0


def tensor_plan(
    shape: dict, qtype: Q, vocab_size: int, untied: bool = False
) -> list[tuple[str, Q, tuple[int, ...]]]:
    """(GGUF name, type, PyTorch shape [out, in] or [n]) of every tensor, in file order; untied:
    with an output.weight of its own (Q8_0, or Q6_K in Q4_K_M with a Q4_K embedding, as
    llama.cpp writes an 8B Llama's)."""
    h, f, d = shape["hidden_size"], shape["intermediate_size"], head_dim(shape)
    q, kv, n = shape["num_heads"] * d, shape["num_kv_heads"] * d, shape["num_layers"]
    k_mix = qtype == Q.Q4_K  # Q4_K_M
    embedding = (Q.Q4_K if untied else Q.Q6_K) if k_mix else Q.Q8_0
    plan = [("token_embd.weight", embedding, (vocab_size, h))]
    for i in range(n):
        p, more = f"blk.{i}.", Q.Q6_K if k_mix and more_bits(i, n) else qtype
        if "attention_layers" in shape and i not in shape["attention_layers"]:
            plan += [(p + "attn_norm.weight", Q.F32, (h,)), *_mamba_plan(shape, p, qtype)]
        elif is_linear(shape, i):
            plan += [(p + "attn_norm.weight", Q.F32, (h,)), *_gdn_plan(shape, p, qtype)]
        elif shape.get("full_attention_interval"):  # gated: q_proj gives each head's gate too
            plan += [
                (p + "attn_norm.weight", Q.F32, (h,)),
                (p + "attn_q.weight", qtype, (2 * q, h)),
                (p + "attn_k.weight", qtype, (kv, h)),
                (p + "attn_v.weight", more, (kv, h)),
                (p + "attn_output.weight", qtype, (h, q)),
                (p + "attn_q_norm.weight", Q.F32, (d,)),
                (p + "attn_k_norm.weight", Q.F32, (d,)),
            ]
        else:
            plan += [
                (p + "attn_norm.weight", Q.F32, (h,)),
                (p + "attn_q.weight", qtype, (q, h)),
                (p + "attn_k.weight", qtype, (kv, h)),
                (p + "attn_v.weight", more, (kv, h)),
                (p + "attn_output.weight", qtype, (h, q)),
            ]
        norm = "post_attention_norm" if shape.get("full_attention_interval") else "ffn_norm"
        plan.append((p + f"{norm}.weight", Q.F32, (h,)))
        if shape.get("num_experts"):  # Mixtral's layout: stacked [experts, out, in] tensors
            e, fe = shape["num_experts"], shape["expert_size"]
            plan += [
                (p + "ffn_gate_inp.weight", ROUTER, (e, h)),
                (p + "ffn_gate_exps.weight", qtype, (e, fe, h)),
                (p + "ffn_up_exps.weight", qtype, (e, fe, h)),
                (p + "ffn_down_exps.weight", more, (e, h, fe)),
            ]
        else:
            plan += [
                (p + "ffn_gate.weight", qtype, (f, h)),
                (p + "ffn_up.weight", qtype, (f, h)),
                (p + "ffn_down.weight", more, (h, f)),
            ]
    plan.append(("output_norm.weight", Q.F32, (h,)))
    if untied:
        plan.append(("output.weight", Q.Q6_K if k_mix else Q.Q8_0, (vocab_size, h)))
    return plan


def _mamba_plan(shape: dict, p: str, qtype: Q) -> list[tuple[str, Q, tuple[int, ...]]]:
    """A Mamba-2 layer's tensors as llama.cpp's granitehybrid files hold them."""
    h, heads, groups = shape["hidden_size"], shape["mamba_heads"], shape["mamba_groups"]
    inner, state = heads * shape["mamba_head_dim"], shape["mamba_state"]
    conv_dim = inner + 2 * groups * state
    return [
        (p + "ssm_in.weight", qtype, (inner + conv_dim + heads, h)),
        (p + "ssm_conv1d.weight", SMALL, (conv_dim, shape["mamba_conv"])),
        (p + "ssm_conv1d.bias", SMALL, (conv_dim,)),
        (p + "ssm_dt.bias", SMALL, (heads,)),
        (p + "ssm_a", NEGATIVE, (heads, 1)),
        (p + "ssm_d", Q.F32, (heads, 1)),
        (p + "ssm_norm.weight", Q.F32, (groups, inner // groups)),
        (p + "ssm_out.weight", qtype, (h, inner)),
    ]


def _gdn_plan(shape: dict, p: str, qtype: Q) -> list[tuple[str, Q, tuple[int, ...]]]:
    """A Gated DeltaNet layer's tensors as llama.cpp's qwen35 files hold them."""
    h, heads, dim = shape["hidden_size"], shape["linear_heads"], shape["linear_head_dim"]
    inner = heads * dim
    return [
        (p + "attn_qkv.weight", qtype, (3 * inner, h)),
        (p + "attn_gate.weight", qtype, (inner, h)),
        (p + "ssm_conv1d.weight", SMALL, (3 * inner, shape["linear_conv"])),
        (p + "ssm_dt.bias", SMALL, (heads,)),
        (p + "ssm_a", NEGATIVE, (heads,)),
        (p + "ssm_beta.weight", SMALL, (heads, h)),
        (p + "ssm_alpha.weight", SMALL, (heads, h)),
        (p + "ssm_norm.weight", Q.F32, (dim,)),
        (p + "ssm_out.weight", qtype, (h, inner)),
    ]


def tensor_nbytes(qtype: Q, shape: tuple[int, ...]) -> int:
    if qtype in (ROUTER, SMALL, NEGATIVE):
        qtype = Q.F32
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"row length {shape[-1]} is not a multiple of {qtype.name}'s {block}")
    return int(np.prod(shape)) // block * type_size


def random_tensor(rng: np.random.Generator, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """F32 norms as ones; a quantized [out, in] weight as its raw bytes [out, bytes_per_row]:
    random codes, the scale d (and Q4_1's m = -8 d; the K-quants' sub-block scales 1 and Q4_K's
    offsets -8 d) fixed so weights have std WEIGHT_STD, centred."""
    if qtype == ROUTER:
        return rng.standard_normal(shape, dtype=np.float32)
    if qtype == SMALL:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
    if qtype == NEGATIVE:
        return -rng.uniform(1, 16, shape).astype(np.float32)
    if qtype == Q.F32:
        return np.ones(shape, dtype=np.float32)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, n_blocks = int(np.prod(shape[:-1])), shape[-1] // block
    data = rng.integers(0, 256, (rows, n_blocks, type_size), dtype=np.uint8)
    d = np.frombuffer(np.float16(WEIGHT_STD / CODE_STD[qtype]).tobytes(), dtype=np.uint8)
    if qtype == Q.Q6_K:  # ..., 16 int8 sub-block scales, d
        data[:, :, 192:208] = 1
        data[:, :, 208:210] = d
        return data.reshape(*shape[:-1], n_blocks * type_size)
    data[:, :, 0:2] = d
    if qtype == Q.Q4_1:
        data[:, :, 2:4] = np.frombuffer(np.float16(-8 * d.view(np.float16)[0]).tobytes(), np.uint8)
    if qtype == Q.Q4_K:  # d, dmin = d, 6-bit (sc, m) packed: every sc 1, every m 8
        data[:, :, 2:4] = d
        data[:, :, 4:16] = np.array([1] * 4 + [8] * 4 + [0x81] * 4, np.uint8)
    return data.reshape(*shape[:-1], n_blocks * type_size)


def copy_tokenizer(writer: gguf.GGUFWriter, source: str | Path) -> int:
    """Copy every tokenizer.* key of `source` with its GGUF types; returns the vocabulary size."""
    reader = gguf.GGUFReader(source)
    vocab_size = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
        if key == gguf.Keys.Tokenizer.LIST:
            vocab_size = len(field.data)
    return vocab_size


def write_random_gguf(
    path: str | Path,
    shape: str = "llama-1b",
    qtype: str = "Q4_1",
    seed: int = 0,
    untied: bool = False,
    **overrides,
) -> dict:
    """Write the file; `overrides` (hidden_size, num_layers, ...) replace the shape's values.
    Returns its path, size in bytes, parameter count and seconds taken."""
    start = time.perf_counter()
    dims = {**SHAPES[shape], **{k: v for k, v in overrides.items() if v is not None}}
    proj = PROJ_TYPES[qtype]
    if dims["hidden_size"] % dims["num_heads"] or dims["num_heads"] % dims["num_kv_heads"]:
        raise ValueError(f"heads must divide hidden_size and kv heads divide heads: {dims}")
    hybrid = "attention_layers" in dims
    gdn = bool(dims.get("full_attention_interval"))
    arch = "qwen35" if gdn else "granitehybrid" if hybrid else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"random-{shape}-{qtype.lower()}")
    w.add_block_count(dims["num_layers"])
    w.add_context_length(dims["context_length"])
    w.add_embedding_length(dims["hidden_size"])
    # llama.cpp's "llama" files with experts (Mixtral's) size the experts by feed_forward_length
    w.add_feed_forward_length(dims.get("expert_size") or dims["intermediate_size"])
    w.add_head_count(dims["num_heads"])
    if hybrid:  # llama.cpp's per-layer KV heads: 0 for a Mamba layer
        w.add_head_count_kv([dims["num_kv_heads"] if i in dims["attention_layers"] else 0
                             for i in range(dims["num_layers"])])  # fmt: skip
        inner = dims["mamba_heads"] * dims["mamba_head_dim"]
        w.add_ssm_conv_kernel(dims["mamba_conv"])
        w.add_ssm_state_size(dims["mamba_state"])
        w.add_ssm_group_count(dims["mamba_groups"])
        w.add_ssm_inner_size(inner)
        w.add_ssm_time_step_rank(dims["mamba_heads"])
        w.add_expert_shared_feed_forward_length(dims["intermediate_size"])
        w.add_rope_scaling_finetuned(False)  # no RoPE, as Granite 4.0-H
    elif gdn:  # the Gated DeltaNet's sizes in the ssm keys, as llama.cpp's converter writes
        w.add_head_count_kv(dims["num_kv_heads"])
        heads, dim, n = dims["linear_heads"], dims["linear_head_dim"], dims["num_layers"]
        w.add_ssm_conv_kernel(dims["linear_conv"])
        w.add_ssm_state_size(dim)
        w.add_ssm_group_count(heads)
        w.add_ssm_time_step_rank(heads)
        w.add_ssm_inner_size(heads * dim)
        w.add_array(f"{arch}.attention.recurrent_layers", [is_linear(dims, i) for i in range(n)])
        w.add_full_attention_interval(dims["full_attention_interval"])
        w.add_rope_dimension_sections([11, 11, 10, 0])
    else:
        w.add_head_count_kv(dims["num_kv_heads"])
    w.add_layer_norm_rms_eps(dims["rms_eps"])
    w.add_rope_freq_base(dims["rope_theta"])
    w.add_rope_dimension_count(head_dim(dims) // 4 if gdn else head_dim(dims))
    w.add_key_length(head_dim(dims))
    w.add_value_length(head_dim(dims))
    if dims.get("num_experts"):
        w.add_expert_count(dims["num_experts"])
        w.add_expert_used_count(dims["experts_used"])
        w.add_expert_feed_forward_length(dims["expert_size"])
    w.add_file_type(FILE_TYPES[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab_size = copy_tokenizer(w, resolve_model(None))
    w.add_vocab_size(vocab_size)
    plan = tensor_plan(dims, proj, vocab_size, untied)
    n_params = 0
    for name, t, shp in plan:  # the tensor infos first, so data can follow one at a time
        nbytes = tensor_nbytes(t, shp)
        if t in (Q.F32, ROUTER, SMALL, NEGATIVE):
            w.add_tensor_info(name, shp, np.dtype(np.float32), nbytes)
        else:
            rows = int(np.prod(shp[:-1]))
            byte_shape = (*shp[:-1], nbytes // rows)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=t)
        n_params += int(np.prod(shp))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, t, shp in plan:
        w.write_tensor_data(random_tensor(rng, t, shp))
    w.close()
    size = Path(path).stat().st_size
    return dict(path=str(path), bytes=size, params=n_params, seconds=time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the .gguf file to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument(
        "--type",
        choices=list(PROJ_TYPES),
        default="Q4_1",
        help="the projections' quantization (token_embd Q8_0, or as Q4_K_M has it)",
    )
    parser.add_argument("--untied", action="store_true",
                        help="an output.weight of its own, as Llama 3 8B has")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    for flag in ("hidden-size", "intermediate-size", "num-layers", "num-heads", "num-kv-heads"):
        parser.add_argument(f"--{flag}", type=int, help="overrides the shape's value")
    args = parser.parse_args(argv)
    overrides = {
        k: getattr(args, k)
        for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
    }
    info = write_random_gguf(args.out, args.shape, args.type, args.seed, args.untied, **overrides)
    print(
        f"wrote {info['path']}: {info['bytes']} bytes ({info['bytes'] / 2**20:.1f} MiB), "
        f"{info['params'] / 1e9:.3f}B parameters, in {info['seconds']:.1f} s"
    )
    return info


if __name__ == "__main__":
    main()
