"""`python -m benchmarks.sliding_window` on a tiny Qwen2 with full and sliding layers: the released
run holds fewer blocks at its peak than the kept one, with the same tokens."""

import pytest
import torch

from benchmarks import sliding_window
from pagedllm.config import EngineArgs

transformers = pytest.importorskip("transformers")


def test_released_blocks_lower_the_peak(tmp_path):
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        use_sliding_window=True, sliding_window=8, max_window_layers=2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    args = EngineArgs(model=str(tmp_path), block_size=4, kv_cache_memory="4MiB")
    result = sliding_window.run(args, [8, 60], output_len=8)
    short, long = result["rows"]
    assert all(r["same_tokens"] for r in result["rows"])
    # Kept: every token's block in both groups. Released: at its peak (the 60-token prompt,
    # prefilled in one chunk, has all its blocks live) still less.
    assert short["peak_blocks_kept"] == 2 * 4 and long["peak_blocks_kept"] == 2 * 17
    assert short["peak_blocks_released"] <= short["peak_blocks_kept"]
    assert long["peak_blocks_released"] == 15 + 15 < long["peak_blocks_kept"]
    table = sliding_window.format_table(result)
    assert "saved" in table and "NO" not in table
    assert long["last_blocks_released"] == 17 + 3  # decoding: 3 sliding blocks (window 8)
