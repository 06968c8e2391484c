"""Batch invariance (--deterministic: the default in float32, asked for in bfloat16): the same
request gives the same tokens and the same log-probabilities, bit for bit, alone or beside other
requests, as a prefix-cache hit, chunked, with any block size, after a preemption, and with the
fused decoder or the modules (docs/determinism.md). A tiny random Llama (its logits are close
together, so a changed sum shows in the log-probabilities at once) in both dtypes, and the real
default model (slow)."""

from __future__ import annotations

import gguf
import pytest

from pagedllm import LLM, SamplingParams, kernels
from tests.conftest import save_tiny_llama
from tests.model_loader.tiny_gguf import gpt2_vocab, random_hf_weights, write_tiny_llama

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")

TARGET = [(11 * j) % 120 + 3 for j in range(37)]  # 37 tokens: blocks of 16 and a part
# Other requests of mixed lengths, as many as a test asks for.
OTHERS = [[(7 * i + 13 * j) % 120 + 3 for j in range(3 + (17 * i) % 60)] for i in range(31)]


@pytest.fixture(scope="module", params=["float32", "bfloat16", "auto"])
def tiny(request, tmp_path_factory):
    """(path, dtype): float32 by default, bfloat16 with --deterministic; auto: a Q4_1 GGUF with
    no flag, the integer products of the default path (layers/quantization/int8_act.py)."""
    path = tmp_path_factory.mktemp("tiny-llama-invariance")
    if request.param == "auto":
        weights = random_hf_weights(len(gpt2_vocab()[0]), seed=5)
        return str(
            write_tiny_llama(path / "q4_1.gguf", weights, gguf.GGMLQuantizationType.Q4_1)
        ), "auto"
    save_tiny_llama(path, seed=5, max_position_embeddings=512)
    return str(path), request.param


def make_llm(tiny, **kwargs):
    path, dtype = tiny
    kwargs.setdefault("max_model_len", 256)
    # A small pool: 4 GiB of this model's blocks would be millions of blocks to set up.
    kwargs.setdefault("kv_cache_memory", "64MiB")
    if dtype == "bfloat16":
        kwargs["deterministic"] = True
    llm = LLM(model=path, dtype=dtype, **kwargs)
    config = llm.llm_engine.config
    assert (config.model.quantization == "int8_act") == (dtype == "auto")
    # Beside the integer products the cache holds float16 (half float32's blocks' bytes).
    want = "float16" if dtype == "auto" else dtype
    assert config.cache.cache_dtype == kwargs.get("kv_cache_dtype", want)
    return llm


def greedy(n=24):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)


def run(llm, params, others=(), other_params=None):
    """The target's (tokens, logprobs), submitted after `others`."""
    prompts = [{"prompt_token_ids": p} for p in [*others, TARGET]]
    rest = other_params or SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    outs = llm.generate(prompts, [rest] * len(others) + [params], use_tqdm=False)
    out = outs[-1].outputs[0]
    return out.token_ids, out.logprobs


@pytest.fixture(scope="module")
def alone(tiny):
    return run(make_llm(tiny), greedy())


@pytest.mark.parametrize("num_others", [1, 7, 31])
def test_same_beside_other_requests(tiny, alone, num_others):
    assert run(make_llm(tiny), greedy(), OTHERS[:num_others]) == alone


def test_same_as_a_prefix_cache_hit_and_as_16_copies(tiny, alone):
    llm = make_llm(tiny, enable_prefix_caching=True)
    assert run(llm, greedy()) == alone
    hits = llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits
    assert run(llm, greedy()) == alone  # its first 32 tokens from the cache
    assert llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits >= hits + 32
    outs = llm.generate([{"prompt_token_ids": TARGET}] * 16, greedy(), use_tqdm=False)
    assert all((o.outputs[0].token_ids, o.outputs[0].logprobs) == alone for o in outs)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_same_chunked_and_with_any_block_size(tiny, alone, block_size):
    llm = make_llm(tiny, block_size=block_size, enable_chunked_prefill=True,
                   max_num_batched_tokens=13)  # fmt: skip
    assert run(llm, greedy(), OTHERS[:3]) == alone


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_same_after_preemption(tiny, alone, mode):
    llm = make_llm(tiny, block_size=4, num_gpu_blocks_override=40, preemption_mode=mode,
                   max_model_len=128, swap_space=0.01)  # fmt: skip
    others = OTHERS[10:18]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert run(llm, greedy(), others, params) == alone
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


def test_same_with_the_modules_as_with_the_fused_decoder(tiny, alone):
    assert run(make_llm(tiny, enforce_eager=True), greedy(), OTHERS[:7]) == alone


def test_seeded_sampling_same_alone_and_batched(tiny):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, logprobs=2)
    first = run(make_llm(tiny), params)
    sampled = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    assert run(make_llm(tiny), params, OTHERS[:7], sampled) == first


@pytest.mark.slow
def test_default_model_same_alone_batched_and_cached():
    # No flag: the default's integer products are batch invariant by construction.
    llm = LLM(kv_cache_memory="256MiB", max_model_len=512, enable_prefix_caching=True)
    assert llm.llm_engine.config.model.quantization == "int8_act"
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    first = run(llm, params)
    assert run(llm, params, OTHERS[:7]) == first  # beside others, and a prefix-cache hit
    assert run(llm, params, OTHERS[7:31]) == first


def test_deterministic_is_the_float32_default_and_refused_where_no_kernel_has_it(tmp_path):
    from pagedllm.config import EngineArgs
    from pagedllm.cpu_info import has_native_bf16
    from pagedllm.engine.arg_utils import create_engine_config
    from pagedllm.entrypoints.cli import build_parser

    save_tiny_llama(tmp_path)

    def resolved(**kwargs) -> bool:
        args = EngineArgs(model=str(tmp_path), device="cpu", **kwargs)
        return create_engine_config(args).model.deterministic

    assert resolved(dtype="float32") and resolved(dtype="bfloat16", deterministic=True)
    assert not resolved(dtype="float32", deterministic=False)
    # bfloat16: on where its GEMMs are emulated (the fixed-order kernels are faster there)
    assert resolved(dtype="bfloat16") == (not has_native_bf16())
    assert not resolved(dtype="float32", attention_backend="sdpa")
    for refused in ({"dtype": "float16"}, {"dtype": "float32", "attention_backend": "sdpa"}):
        with pytest.raises(ValueError, match="--deterministic needs the CPU attention kernels"):
            resolved(deterministic=True, **refused)
    ns = build_parser().parse_args(["serve", "--enable-deterministic-inference"])
    assert ns.deterministic is True
    assert build_parser().parse_args(["serve", "--no-deterministic"]).deterministic is False
