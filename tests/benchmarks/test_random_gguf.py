"""`python -m benchmarks.random_gguf`: the tiny shape in each projection type is a file pagedllm
reads back at the written shape, of the size the shape predicts, and generates from."""

from __future__ import annotations

import gguf
import pytest

from benchmarks import random_gguf
from pagedllm import LLM, SamplingParams
from pagedllm.model_loader.loader import load_model_config

ALIGN = gguf.GGUF_DEFAULT_ALIGNMENT


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0", "Q4_K_M"])
def test_tiny_file_loads_and_generates(tmp_path, qtype, capsys):
    path = tmp_path / f"tiny-{qtype}.gguf"
    info = random_gguf.main([str(path), "--shape", "tiny", "--type", qtype, "--seed", "1"])
    assert str(path) in capsys.readouterr().out
    shape = random_gguf.SHAPES["tiny"]

    config, _ = load_model_config(str(path))
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        shape["hidden_size"], shape["intermediate_size"], shape["num_layers"],
    )  # fmt: skip
    assert (config.num_attention_heads, config.num_key_value_heads) == (
        shape["num_heads"], shape["num_kv_heads"],
    )  # fmt: skip
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.head_dim == shape["hidden_size"] // shape["num_heads"]

    plan = random_gguf.tensor_plan(shape, random_gguf.PROJ_TYPES[qtype], 49152)
    data = sum(-(-random_gguf.tensor_nbytes(t, s) // ALIGN) * ALIGN for _, t, s in plan)
    size = path.stat().st_size
    assert info["bytes"] == size and data <= size <= data + 16 * 2**20
    assert {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors} == {
        name: t for name, t, _ in plan
    }

    llm = LLM(model=str(path), kv_cache_memory="64MiB", max_model_len=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        out = llm.generate(["Hello"], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(out[0].outputs[0].token_ids) == 8


def test_overrides_change_the_shape(tmp_path):
    path = tmp_path / "wider.gguf"
    random_gguf.write_random_gguf(path, "tiny", "Q8_0", num_layers=3, hidden_size=512)
    config, _ = load_model_config(str(path))
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (3, 512, 128)


def test_untied_writes_its_own_output_weight(tmp_path):
    path = tmp_path / "untied.gguf"
    random_gguf.main([str(path), "--shape", "tiny", "--type", "Q4_K_M", "--untied"])
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["output.weight"] == gguf.GGMLQuantizationType.Q6_K
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q4_K
    config, _ = load_model_config(str(path))
    assert not config.tie_word_embeddings
