"""The parallel layers' weight loaders and outputs, rank by rank in one process (set_tp_group
without collectives): each rank's slice of every checkpoint tensor, and the ranks' parts adding
up to the one-rank layer. tests/distributed runs whole models on real groups."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed import HeadShard, TPGroup, set_tp_group
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def ranks():
    """A function running f() as each rank of a group of `size`, returning their results."""

    def run(size, f):
        out = []
        for rank in range(size):
            set_tp_group(rank, size)
            out.append(f())
        return out

    yield run
    set_tp_group(0, 1)


@pytest.mark.parametrize(
    "heads, kv_heads, size", [(4, 2, 2), (4, 1, 2), (6, 3, 2), (8, 2, 4), (4, 4, 1)]
)
@pytest.mark.parametrize("stored", ["parts", "fused"])
def test_qkv_rows_follow_the_head_split(ranks, heads, kv_heads, size, stored):
    d, hidden = 8, 32
    q, k, v = (torch.randn(n * d, hidden) for n in (heads, kv_heads, kv_heads))
    bias = [torch.randn(n * d) for n in (heads, kv_heads, kv_heads)]

    def load():
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, bias=True)
        if stored == "parts":
            for i, (w, b) in enumerate(zip((q, k, v), bias, strict=True)):
                layer.weight_loader(layer.weight, w, i)
                layer.weight_loader(layer.bias, b, i)
        else:  # Phi-3's checkpoints: q, k and v in one tensor
            layer.weight_loader(layer.weight, torch.cat([q, k, v]))
            layer.weight_loader(layer.bias, torch.cat(bias))
        return layer

    for rank, layer in enumerate(ranks(size, load)):
        s = HeadShard.of(heads, kv_heads, TPGroup(rank, size))
        rows = lambda t, start, n: t[start * d : (start + n) * d]  # noqa: E731
        want = [rows(q, s.q_start, s.num_heads), rows(k, s.kv_start, s.num_kv_heads),
                rows(v, s.kv_start, s.num_kv_heads)]  # fmt: skip
        assert torch.equal(layer.weight, torch.cat(want))
        assert (layer.q_size, layer.kv_size) == (s.num_heads * d, s.num_kv_heads * d)
        assert layer.output_columns == (s.q_start * d, s.num_heads * d)
        want_bias = torch.cat([rows(bias[0], s.q_start, s.num_heads),
                               rows(bias[1], s.kv_start, s.num_kv_heads),
                               rows(bias[2], s.kv_start, s.num_kv_heads)])  # fmt: skip
        assert torch.equal(layer.bias, want_bias)


def test_merged_and_row_parallel_layers_add_up_to_one_rank(ranks):
    """gate/up halves, then down's columns: the ranks' partial outputs sum to the whole layer's
    (the all-reduce's job), the bias counted once."""
    hidden, inter = 32, 48
    gate, up, down = (
        torch.randn(inter, hidden),
        torch.randn(inter, hidden),
        torch.randn(hidden, inter),
    )
    down_bias = torch.randn(hidden)
    x = torch.randn(5, hidden)

    def mlp():
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter])
        gate_up.weight_loader(gate_up.weight, up, 1)
        gate_up.weight_loader(gate_up.weight, gate, 0)
        down_proj = RowParallelLinear(inter, hidden, bias=True, reduce_results=False)
        down_proj.weight_loader(down_proj.weight, down)
        down_proj.weight_loader(down_proj.bias, down_bias)
        g, u = gate_up(x).chunk(2, dim=-1)
        return down_proj(torch.nn.functional.silu(g) * u)

    (whole,) = ranks(1, mlp)
    parts = ranks(2, mlp)
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(parts[0], whole)


def test_split_sizes_must_divide(ranks):
    with pytest.raises(ValueError, match="does not divide mlp.gate_up_proj's output rows"):
        ranks(2, lambda: MergedColumnParallelLinear(32, [7, 7], prefix="mlp.gate_up_proj"))


def test_shapes_are_the_whole_layers(ranks):
    layer = ranks(2, lambda: ColumnParallelLinear(32, 64))[1]
    with pytest.raises(ValueError, match=r"has shape \(32, 32\), expected \(64, 32\)"):
        layer.weight_loader(layer.weight, torch.randn(32, 32))  # a rank's slice is not taken


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_vocabulary_rows_padded(ranks, quantization):
    """127 rows over 2 ranks: 64 each, the last one zeros (its logits are cut after the
    gather); the embedding's tokens of the other rank embed as zeros before the all-reduce."""
    vocab, hidden = 127, 64
    weight = torch.randn(vocab, hidden)

    def load():
        embed = VocabParallelEmbedding(vocab, hidden)
        embed.weight_loader(embed.weight, weight)
        head = ParallelLMHead(vocab, hidden, quant_config=QuantizationConfig(quantization))
        head.weight_loader(head.weight, weight)
        return embed, head

    (one,) = ranks(1, load)
    two = ranks(2, load)
    for embed, _ in two:
        assert embed.num_embeddings == 64
    assert torch.equal(torch.cat([e.weight for e, _ in two])[:vocab], weight)
    assert not two[1][0].weight[-1].any()
    x = torch.randn(3, hidden)
    logits = torch.cat([head(x) for _, head in two], dim=-1)
    assert not logits[:, vocab:].any()
    torch.testing.assert_close(logits[:, :vocab], one[1](x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_rows_and_columns_shard_like_the_codes(ranks, quantization):
    """A rank's codes are its slice of the one-rank layer's: rows freely, columns on whole
    groups of 32; a split off the groups is refused when the layer is built."""
    config = QuantizationConfig(quantization)
    w = torch.randn(64, 128)

    def load(layer_cls, **kwargs):
        def f():
            layer = layer_cls(128, 64, quant_config=config, **kwargs)
            layer.weight_loader(layer.weight, w)
            return layer

        return f

    x = torch.randn(2, 128)
    (whole,) = ranks(1, load(RowParallelLinear, reduce_results=False))
    parts = ranks(2, load(RowParallelLinear, reduce_results=False))
    for name in ("weight", "weight_scale"):  # int4's two codes a byte: whole blocks still
        assert torch.equal(torch.cat([getattr(p, name) for p in parts], 1), getattr(whole, name))
    torch.testing.assert_close(parts[0](x[:, :64]) + parts[1](x[:, 64:]), whole(x))
    (whole,) = ranks(1, load(ColumnParallelLinear))
    parts = ranks(2, load(ColumnParallelLinear))
    assert torch.equal(torch.cat([p.weight for p in parts]), whole.weight)
    with pytest.raises(ValueError, match="input columns 0..48 of o_proj, which are not whole"):
        ranks(2, lambda: RowParallelLinear(96, 64, quant_config=config, prefix="o_proj"))
