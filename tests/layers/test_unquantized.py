"""Float linear layers: bfloat16 weights prepacked for oneDNN once loaded, against F.linear; a
tied LM head's packed copy; where packing applies."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization import QuantizationConfig, UnquantizedLinearMethod, unquantized
from pagedllm.layers.quantization.unquantized import can_pack
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.weight_utils import weight_bytes

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not can_pack(torch.bfloat16, CPU), reason="needs oneDNN's bfloat16 path on this CPU"
)
PACKED = QuantizationConfig(prepack=True)


def _processed(layer):
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 130, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    layer = ColumnParallelLinear(80, 96, bias, torch.bfloat16, PACKED)
    layer.weight_loader(layer.weight, weight)
    if bias:
        layer.weight_loader(layer.bias, b)
    _processed(layer)
    assert not hasattr(layer, "weight") and layer.nbytes == weight.nbytes
    x = torch.randn(rows, 80, generator=g).bfloat16()
    out = layer(x)
    assert out.shape == (rows, 96) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, weight, b).float(), atol=0.05, rtol=0.02)
    # Leading dimensions and a non-contiguous input are handled.
    x3 = torch.randn(2, 80, rows, generator=g).bfloat16().transpose(1, 2)
    torch.testing.assert_close(
        layer(x3).float(), F.linear(x3, weight, b).float(), atol=0.05, rtol=0.02
    )


def test_packed_gemms_run_at_few_row_counts():
    """The row counts a packed GEMM runs at: exact up to 16, never fewer rows than given, at
    most 1/8 more, and 72 shapes for every step of up to 2048 rows (oneDNN keeps a primitive
    per shape)."""
    padded = [unquantized.padded_rows(r) for r in range(1, 4097)]
    assert padded[:16] == list(range(1, 17))
    assert all(r <= p <= r * 9 / 8 for r, p in zip(range(1, 4097), padded, strict=True))
    assert len(set(padded[:2048])) == 72
    assert padded == sorted(padded)


def test_the_fused_decoder_pads_rows_as_the_layers_do():
    from pagedllm import kernels

    if not kernels.available():
        pytest.skip("the C++ kernels are not available")
    padded = kernels.cpu_ops().padded_rows
    assert all(padded(r) == unquantized.padded_rows(r) for r in range(1, 9000))


@needs_onednn
def test_warming_runs_each_distinct_packed_shape_at_each_row_count():
    from pagedllm.layers.linear import warm_packed_products

    def linear(i, o, bias=False):
        return _processed(ColumnParallelLinear(i, o, bias, torch.bfloat16, PACKED))

    head = _processed(ParallelLMHead(50, 32, torch.bfloat16, PACKED))
    model = torch.nn.ModuleList([linear(32, 48), linear(32, 48), linear(48, 32), head])
    model.append(linear(32, 48, bias=True))  # a bias is another primitive
    model.append(ColumnParallelLinear(32, 48, False, torch.bfloat16))  # not packed: not run
    counts = len({unquantized.padded_rows(r) for r in range(1, 101)})
    head_counts = len({unquantized.padded_rows(r) for r in range(1, 21)})
    assert warm_packed_products(model, 100, head, 20) == 3 * counts + head_counts
    # The head's shape met again in a body layer is run to the body's limit.
    model.append(linear(32, 50))
    assert warm_packed_products(model, 100, head, 20) == 4 * counts


ENGINE_SHAPES = """
import sys
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", deterministic=False, kv_cache_memory="16MiB",
          max_model_len=256, max_num_batched_tokens=256)
print("SERVING", flush=True)
prompts = [{"prompt_token_ids": list(range(3, 3 + 5 + 5 * i))} for i in range(30)]
params = [SamplingParams(max_tokens=1 + 3 * i, ignore_eos=True) for i in range(30)]
llm.generate(prompts, params)
"""


@needs_onednn
def test_an_engine_makes_no_onednn_primitive_while_serving(tmp_path):
    """oneDNN's creation log (ONEDNN_VERBOSE) is empty of product shapes from the first step
    on: prefill chunks, decode batches of every size from 30 down to 1 (the fused decoder's)
    and the LM head all run at shapes the worker made at start."""
    import os
    import subprocess
    import sys

    from tests.conftest import save_tiny_llama

    save_tiny_llama(tmp_path, vocab_size=512, max_position_embeddings=256)
    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create"}
    run = subprocess.run([sys.executable, "-c", ENGINE_SHAPES, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    before, serving, after = run.stdout.partition("SERVING")
    assert serving and before.count("create:cache_miss") >= 4 * 30
    made = [line for line in after.splitlines() if "create:cache_miss" in line]
    assert made == []


@needs_onednn
def test_a_tied_head_gets_a_packed_copy():
    embed = VocabParallelEmbedding(50, 32, torch.bfloat16)
    head = ParallelLMHead(50, 32, torch.bfloat16, PACKED, tied=True)
    head.tie_weights(embed)
    weight = torch.randn(50, 32)
    embed.weight_loader(embed.weight, weight)
    x = torch.randn(5, 32).bfloat16()
    before, bytes_before = head(x), weight_bytes(torch.nn.ModuleList([embed, head]))
    _processed(head)
    assert embed.weight.dtype == torch.bfloat16  # the embedding keeps the original
    assert weight_bytes(torch.nn.ModuleList([embed, head])) == bytes_before + 50 * 32 * 2
    torch.testing.assert_close(head(x).float(), before.float(), atol=0.05, rtol=0.02)


def test_which_layers_pack():
    def method(config, input_size=64, tied=False):
        head = ParallelLMHead(128, input_size, quant_config=config, tied=tied)
        assert isinstance(head.quant_method, UnquantizedLinearMethod)
        return head.quant_method.prepack

    assert method(PACKED) and method(PACKED, tied=True)
    assert not method(QuantizationConfig())
    # A quantized model's float layers (inputs not whole groups of 32) pack, but a tied head
    # stays as it is: quantizing is chosen to save memory.
    quantized = QuantizationConfig("int8", prepack=True)
    assert method(quantized, 48) and not method(quantized, 48, tied=True)


def test_packing_needs_bfloat16_on_a_cpu_that_onednn_packs_for(monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    monkeypatch.setattr(
        unquantized, "cpu_flags", lambda: frozenset({"avx2", "avx512bw", "avx512vl", "avx512dq"})
    )
    assert unquantized.can_pack(torch.bfloat16, CPU)
    assert not unquantized.can_pack(torch.float32, CPU)
    assert not unquantized.can_pack(torch.bfloat16, torch.device("cuda"))
    monkeypatch.setattr(unquantized, "cpu_flags", lambda: frozenset({"avx2"}))
    assert not unquantized.can_pack(torch.bfloat16, CPU)  # oneDNN would refuse to reorder
