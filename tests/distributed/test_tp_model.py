"""The sharded model (layers/linear.py on distributed/parallel.py's split) on 2 ranks over gloo
against the same checkpoint on one, both built by model_loader.build as the engine builds them:
logits of every prefill chunk and decode step within float32 tolerance, the same greedy tokens,
and each rank holding about half of the parameters (embeddings aside). Llama's variants, every
other architecture of the registry (Gemma 3 and the mixtures of experts included: the experts
split by their intermediate size), and int8 / int4 weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from pagedllm.distributed import set_tp_group
from tests.conftest import save_tiny_llama
from tests.model_loader.tiny_gguf import gpt2_vocab, random_hf_weights, write_tiny_llama
from tests.server_process import free_port

RANK_SCRIPT = Path(__file__).with_name("tp_rank.py")
sys.path.insert(0, str(RANK_SCRIPT.parent))
from tp_rank import build, decode, output_name  # noqa: E402


def run_ranks(specs: list[str], out_dir, size: int, dtype: str = "float32") -> None:
    """tp_rank.py's `size` processes over every "quantization:checkpoint" of specs."""
    port = free_port()
    procs = []
    for rank in range(size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        cmd = [sys.executable, str(RANK_SCRIPT), str(out_dir), dtype, *specs]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=600)[1] for p in procs]
    failed = [f"rank {r}: {e[-2000:]}" for r, (p, e) in enumerate(zip(procs, errors, strict=True))
              if p.returncode != 0]  # fmt: skip
    assert not failed, "\n".join(reversed(failed))  # the first to fail is usually the last rank


def one_rank(spec: str, dtype: str = "float32"):
    """(logits of every step, parameter count) of the checkpoint on this process alone."""
    set_tp_group(0, 1)
    quantization, _, checkpoint = spec.partition(":")
    model = build(checkpoint, dtype, quantization)
    return decode(model), sum(p.numel() for p in model.parameters())


def assert_two_ranks_match(spec: str, out_dir, atol=1e-5) -> None:
    expected, _ = one_rank(spec)
    got = torch.load(out_dir / output_name(spec) / "logits.pt")
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=atol, rtol=1e-5)
        assert torch.equal(g.argmax(-1), e.argmax(-1))


LLAMAS = {
    "kv2": dict(num_key_value_heads=2),  # one KV head per rank
    "kv1": dict(num_key_value_heads=1),  # fewer KV heads than ranks: replicated
    # biases rank 0 adds once; a padded, tied vocabulary
    "bias_tied_odd_vocab": dict(
        num_key_value_heads=4,
        attention_bias=True,
        mlp_bias=True,
        vocab_size=127,
        tie_word_embeddings=True,
    ),  # fmt: skip
    "uneven_kv3": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3),  # 2 and 1
}


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """Every LLAMAS checkpoint, run on 2 ranks in one launch: name -> (spec, output dir)."""
    root = tmp_path_factory.mktemp("llamas")
    specs = {}
    for seed, (name, overrides) in enumerate(LLAMAS.items()):
        save_tiny_llama(root / name, seed=3 + seed, **overrides)
        specs[name] = f"none:{root / name}"
    run_ranks(list(specs.values()), root / "out", 2)
    return specs, root / "out"


@pytest.mark.parametrize("name", list(LLAMAS))
def test_two_ranks_match_one(llamas, name):
    specs, out_dir = llamas
    overrides = LLAMAS[name]
    assert_two_ranks_match(specs[name], out_dir)
    if overrides["num_key_value_heads"] == 3:
        return  # an uneven split: the counts are not halves
    _, total_params = one_rank(specs[name])
    ranks = [json.loads((out_dir / output_name(specs[name]) / f"rank{r}.json").read_text())
             for r in range(2)]  # fmt: skip
    embedding = 64 * overrides.get("vocab_size", 128)
    tied = overrides.get("tie_word_embeddings", False)
    rest = total_params - embedding * (1 if tied else 2)
    # Not split: the norms (5 of 64), the o/down biases (both ranks hold them, rank 0 adds
    # them), and a single KV head's k/v projections (2 layers x 2 x 16 x 64), replicated.
    replicated = 64 * 5 + 2 * 2 * 64 * overrides.get("mlp_bias", False)
    replicated += 2 * 2 * 16 * 64 * (overrides["num_key_value_heads"] == 1)
    for r in ranks:
        assert r["embedding"] == 64 * -(-overrides.get("vocab_size", 128) // 2)
        sharded = r["params"] - r["embedding"] * (1 if tied else 2)
        assert rest / 2 <= sharded <= rest / 2 + replicated


def test_four_ranks_share_two_kv_heads(tmp_path):
    """Ranks 0-1 hold KV head 0, ranks 2-3 KV head 1, each with its own query head."""
    save_tiny_llama(tmp_path / "ckpt", seed=4, num_key_value_heads=2)
    spec = f"none:{tmp_path / 'ckpt'}"
    run_ranks([spec], tmp_path / "out", 4)
    assert_two_ranks_match(spec, tmp_path / "out")


def _save_architectures(root: Path) -> dict[str, str]:
    """The tiny random models of tests/models (every architecture of the registry)."""
    import transformers

    from tests.models.test_architectures import ARCHS, BASE
    from tests.models.test_gemma3_parity import make_hf_model

    specs = {}
    for name, (config_cls, model_cls, overrides) in ARCHS.items():
        if "linear_attention" in overrides.get("layer_types", ()) or name.startswith(
            "granite_hybrid"
        ):
            continue  # recurrent layers run on one rank (refused with more: test_hybrid_engine)
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**{**BASE, **overrides})
        getattr(transformers, model_cls)(config).save_pretrained(root / name)
        specs[name] = f"none:{root / name}"
    for name in ("mixed", "softcap"):  # sliding layers, soft-caps, MQA, an untied head
        make_hf_model(name).save_pretrained(root / f"gemma3_{name}")
        specs[f"gemma3_{name}"] = f"none:{root / f'gemma3_{name}'}"
    return specs


@pytest.fixture(scope="module")
def architectures(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    specs = _save_architectures(root)
    run_ranks(list(specs.values()), root / "out", 2)
    return specs, root / "out"


@pytest.mark.parametrize(
    "name",
    ["qwen2", "qwen2_sliding", "qwen3", "mistral", "granite", "phi3", "gemma3_mixed",
     "gemma3_softcap", "qwen3_moe", "qwen3_moe_dense_layer", "mixtral", "gpt_oss"],
)  # fmt: skip
def test_every_architecture_on_two_ranks(architectures, name):
    specs, out_dir = architectures
    assert_two_ranks_match(specs[name], out_dir)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """int8 / int4 on 2 ranks: safetensors (each rank quantizes its slices), and GGUFs whose
    blocks the layers take as they are, sliced (Q4_0 projections; Q8_0 everywhere, the tied
    head from the embedding's codes, over a vocabulary padded to an even size)."""
    root = tmp_path_factory.mktemp("quantized")
    save_tiny_llama(root / "llama", seed=6, num_key_value_heads=2, attention_bias=True)
    weights = random_hf_weights(len(gpt2_vocab()[0]), seed=7)
    write_tiny_llama(root / "q4_0.gguf", weights, gguf.GGMLQuantizationType.Q4_0)
    write_tiny_llama(root / "q8_0.gguf", weights, gguf.GGMLQuantizationType.Q8_0)
    specs = {
        "int4": f"int4:{root / 'llama'}",
        "int8": f"int8:{root / 'llama'}",
        "int4_gguf": f"int4:{root / 'q4_0.gguf'}",
        "int8_gguf": f"int8:{root / 'q8_0.gguf'}",
    }
    run_ranks(list(specs.values()), root / "out", 2)
    return specs, root / "out"


@pytest.mark.parametrize("name", ["int4", "int8", "int4_gguf", "int8_gguf"])
def test_quantized_two_ranks_match_one(quantized, name):
    specs, out_dir = quantized
    assert_two_ranks_match(specs[name], out_dir, atol=1e-4)


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
