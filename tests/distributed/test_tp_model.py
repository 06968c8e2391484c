"""The sharded model (distributed/parallel.py) on 2 ranks over gloo against the same checkpoint
on one: logits of every prefill chunk and decode step within float32 tolerance, the same greedy
tokens, and each rank holding about half of the parameters (embeddings aside)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.model_loader import load_hf_dir
from pagedllm.models import get_model_class
from tests.conftest import save_tiny_llama
from tests.models.paged_runner import PagedRunner
from tests.server_process import free_port

RANK_SCRIPT = Path(__file__).with_name("tp_rank.py")
sys.path.insert(0, str(RANK_SCRIPT.parent))
from tp_rank import PROMPTS  # noqa: E402


def run_ranks(checkpoint, out_dir, size: int, dtype: str = "float32") -> None:
    port = free_port()
    procs = []
    for rank in range(size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        cmd = [sys.executable, str(RANK_SCRIPT), str(checkpoint), str(out_dir), dtype]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=300)[1] for p in procs]
    failed = [f"rank {r}: {e[-2000:]}" for r, (p, e) in enumerate(zip(procs, errors, strict=True))
              if p.returncode != 0]  # fmt: skip
    assert not failed, "\n".join(reversed(failed))  # the first to fail is usually the last rank


def reference_logits(checkpoint, dtype=torch.float32):
    loaded = load_hf_dir(checkpoint)
    model = get_model_class(loaded.config.architecture)(loaded.config, "cpu")
    model.load_weights(loaded.weights)
    model = model.to(dtype).eval()
    reqs = PagedRunner(model, block_size=4, num_blocks=64).generate(PROMPTS, 8, [4, 2, 3])
    return [torch.stack(r.logits) for r in reqs], sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_key_value_heads=2),  # one KV head per rank
        dict(num_key_value_heads=1),  # fewer KV heads than ranks: replicated
        dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True, vocab_size=127,
             tie_word_embeddings=True),  # biases rank 0 adds once; a padded, tied vocabulary
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3),  # 2 KV heads and 1
    ],
    ids=["kv2", "kv1", "bias_tied_odd_vocab", "uneven_kv3"],
)  # fmt: skip
def test_two_ranks_match_one(tmp_path, overrides):
    checkpoint = tmp_path / "ckpt"
    save_tiny_llama(checkpoint, seed=3, **overrides)
    expected, total_params = reference_logits(checkpoint)
    run_ranks(checkpoint, tmp_path, 2)
    got = torch.load(tmp_path / "logits.pt")
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
        assert torch.equal(g.argmax(-1), e.argmax(-1))
    if overrides["num_key_value_heads"] == 3:
        return  # an uneven split: the counts are not halves
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    embedding = 64 * overrides.get("vocab_size", 128)
    tied = overrides.get("tie_word_embeddings", False)
    rest = total_params - embedding * (1 if tied else 2)
    # Not split: the norms (5 of 64), the o/down biases (both ranks hold them, rank 1 zeros),
    # and a single KV head's k/v projections (2 layers x 2 x 16 x 64), replicated.
    replicated = 64 * 5 + 2 * 2 * 64 * overrides.get("mlp_bias", False)
    replicated += 2 * 2 * 16 * 64 * (overrides["num_key_value_heads"] == 1)
    for r in ranks:
        assert r["embedding"] == 64 * -(-overrides.get("vocab_size", 128) // 2)
        sharded = r["params"] - r["embedding"] * (1 if tied else 2)
        assert rest / 2 <= sharded <= rest / 2 + replicated


def test_four_ranks_share_two_kv_heads(tmp_path):
    """Ranks 0-1 hold KV head 0, ranks 2-3 KV head 1, each with its own query head."""
    checkpoint = tmp_path / "ckpt"
    save_tiny_llama(checkpoint, seed=4, num_key_value_heads=2)
    expected, _ = reference_logits(checkpoint)
    run_ranks(checkpoint, tmp_path, 4)
    for e, g in zip(expected, torch.load(tmp_path / "logits.pt"), strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "heads, kv_heads, size, message",
    [(9, 3, 2, None), (6, 3, 2, None), (8, 4, 8, None), (32, 8, 3, None), (8, 1, 4, None),
     (4, 2, 3, "cannot split 4 attention heads with 2 KV heads"),
     (12, 4, 6, "must be a multiple of the KV heads"), (4, 1, 3, "divide the attention heads")],
)  # fmt: skip
def test_head_split(heads, kv_heads, size, message):
    from pagedllm.distributed import HeadShard, TPGroup

    if message is not None:
        with pytest.raises(ValueError, match=message):
            HeadShard.of(heads, kv_heads, TPGroup(0, size))
        return
    shards = [HeadShard.of(heads, kv_heads, TPGroup(r, size)) for r in range(size)]
    group = heads // kv_heads
    # Every query head on exactly one rank, with its own KV head on that rank.
    assert sorted(h for s in shards for h in range(s.q_start, s.q_start + s.num_heads)) == list(
        range(heads)
    )
    for s in shards:
        for h in range(s.q_start, s.q_start + s.num_heads):
            assert s.kv_start <= h // group < s.kv_start + s.num_kv_heads
        assert s.num_heads == s.num_kv_heads * group or s.num_kv_heads == 1
    assert max(s.num_heads for s in shards) - min(s.num_heads for s in shards) <= group
