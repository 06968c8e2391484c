"""`pagedllm kv-calc`: the source documents' arithmetic, GQA, sliding windows, block rounding."""

import json

import pytest

from pagedllm.config import ModelArchConfig
from pagedllm.entrypoints.cli import main
from pagedllm.kv_calc import format_report, kv_memory_report


def test_opt_13b_needs_800_kb_per_token_and_1_6_gb_for_2048_tokens(capsys):
    # OPT-13B: 40 layers, 40 heads of 128 (no GQA), fp16.
    argv = "kv-calc --num-layers 40 --num-kv-heads 40 --head-dim 128 --dtype float16"
    argv = [*argv.split(), "--max-model-len", "2048", "--kv-cache-memory", "12GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token: 819,200 (800.00 KiB)" in out
    assert "one request of 2048 tokens: 1.56 GiB" in out  # 2048 x 800 KiB = 1.68 GB
    assert "fit in 12.00 GiB: 7" in out


def test_sliding_windows_cap_the_sliding_layers():
    # Gemma 3 27B-like: 62 layers, 52 of them sliding (window 1024), 16 KV heads of 128, bf16.
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 10 + ["sliding_attention"] * 2
    config = ModelArchConfig(
        "Gemma3ForCausalLM", 262144, 5376, 21504, 62, 32, 16, 128, sliding_window=1024,
        max_position_embeddings=131072, layer_types=types,
    )  # fmt: skip
    r = kv_memory_report(config, 4096, "4GiB", "bfloat16")
    per_layer_token = 2 * 16 * 128 * 2
    assert r.bytes_per_token_full == 10 * per_layer_token
    assert r.request_bytes == per_layer_token * (10 * 4096 + 52 * 1024)
    assert abs(r.request_bytes / 2**30 - 0.72) < 0.01  # the seeds: "about 0.73 GiB"
    assert r.request_bytes_no_window == per_layer_token * 62 * 4096
    # Blocks: 10 layers per block; 1 full group of 256 blocks, 6 sliding groups of 65 each.
    assert r.spec.group_size == 10 and r.request_blocks == 256 + 6 * 65
    assert r.request_bytes_paged >= r.request_bytes
    assert r.num_requests == (4 * 2**30 // r.spec.bytes_per_block) // r.request_blocks
    # Shorter than the window: every layer keeps everything.
    short = kv_memory_report(config, 512, "4GiB", "bfloat16")
    assert short.request_bytes == short.request_bytes_no_window


def test_a_model_directory_is_read_without_weights(tmp_path, capsys):
    cfg = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "max_position_embeddings": 4096,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["kv-calc", str(tmp_path), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    # 2 x 4 layers x 2 KV heads x 32 dims x 4 bytes = 2048 bytes per token; 4096 tokens = 8 MiB.
    assert "KV bytes per token: 2,048" in out and "GQA" in out
    assert "one request of 4096 tokens: 8.00 MiB" in out
    assert "fit in 4.00 GiB: 512" in out


def test_bad_input_is_a_clear_error(capsys):
    assert main(["kv-calc", "--num-layers", "4"]) == 2
    assert "--num-kv-heads" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dtype"):
        kv_memory_report(ModelArchConfig("x", 1, 1, 1, 1, 1, 1, 1), dtype="int3")


def test_a_hybrid_models_state_is_counted_per_sequence_and_its_mamba_layers_hold_no_kv():
    from pagedllm.model_loader.hf_config import config_from_hf

    cfg = {
        "architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_expand": 2,
    }  # fmt: skip
    config = config_from_hf(cfg)
    r = kv_memory_report(config, max_model_len=1024, kv_cache_memory="1GiB", dtype="float32")
    assert r.bytes_per_token_full == 2 * 2 * 16 * 4  # the one attention layer's K and V
    # 3 layers x (conv: (128 + 2 x 16) channels x 3 inputs x 4 bytes + h: 8 x 16 x 16 x 4)
    assert r.state_bytes == 3 * (160 * 3 * 4 + 8 * 16 * 16 * 4)
    # With prefix caching (the default) checkpoints of the state too: up to one per request in
    # a quarter of the memory.
    assert r.checkpoint_bytes == r.state_bytes
    per_request = r.request_bytes_paged + r.state_bytes
    checkpoints = min(2**28 // r.state_bytes, 2**30 // per_request)
    assert r.num_requests == (2**30 - checkpoints * r.state_bytes) // per_request
    text = format_report(r)
    assert "(3 Mamba-2)" in text and "Mamba state per sequence (3 layers, any length)" in text
    assert "up to as many prefix-caching checkpoints of it in a quarter of the memory" in text
    off = kv_memory_report(config, 1024, "1GiB", "float32", prefix_caching=False)
    assert off.num_requests == 2**30 // per_request
    assert "checkpoints" not in format_report(off)
