"""The default model (GGUF Q4_1, its embedding Q8_0) with weights kept quantized: int4 takes the
file's blocks exactly (the tied LM head its Q8_0 embedding), so with float32 activations its
greedy tokens are the float model's; int8 (and int4 with bfloat16 activations, the fast path)
agree closely, teacher-forced."""

import gc

import pytest
import torch

from benchmarks.quantization import (
    PROMPTS,
    _greedy,
    accuracy,
    continuation_logprobs,
)
from pagedllm import LLM
from pagedllm.attention.kv_quant import FLOAT_DTYPES
from pagedllm.config import EngineArgs
from pagedllm.engine.arg_utils import auto_dtype
from pagedllm.layers.quantization import DualLinearMethod, Int4LinearMethod, Int8LinearMethod
from pagedllm.model_loader import load_gguf, resolve_model
from tests.conftest import runner_of

pytestmark = pytest.mark.slow

NUM_PROMPTS = 4
NUM_TOKENS = 20
ENGINE = dict(kv_cache_memory="128MiB", max_model_len=512)


def test_quantization_flag_is_validated():
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4"):
        EngineArgs(quantization="int3").validate()


def test_gguf_blocks_give_the_dequantized_weights_exactly():
    loaded = load_gguf(resolve_model(None), keep_codes=True)
    # every Q4_1 projection and the Q8_0 embedding
    assert len(loaded.quant_codes) == 7 * loaded.config.num_hidden_layers + 1
    for name, codes in loaded.quant_codes.items():
        assert torch.equal(codes.dequantize(), loaded.weights[name]), name


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(NUM_TOKENS), False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference():
    """float32: prompts, greedy continuations, and their teacher-forced logprobs."""
    llm = LLM(dtype="float32", quantization="none", **ENGINE)
    engine = llm.llm_engine
    prompts = [engine.tokenizer.encode(t) for t in PROMPTS[:NUM_PROMPTS]]
    continuations = _generate(llm, prompts)
    logprobs, _ = continuation_logprobs(engine, prompts, continuations)
    float_bytes = engine.weight_bytes
    del llm, engine
    gc.collect()
    return prompts, continuations, logprobs, float_bytes


def _quantized(reference, **kwargs):
    prompts, continuations, ref_logprobs, float_bytes = reference
    llm = LLM(**kwargs, **ENGINE)
    engine = llm.llm_engine
    tokens = _generate(llm, prompts)
    logprobs, ranks = continuation_logprobs(engine, prompts, continuations)
    acc = accuracy(ref_logprobs, logprobs, ranks)
    return engine, tokens, acc["mean_abs_logprob_diff"], acc["greedy_agreement"]


def test_int4_float32_reproduces_the_float_model(reference):
    engine, tokens, mean_diff, agreement = _quantized(
        reference, dtype="float32", quantization="int4"
    )
    layer = runner_of(engine).model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.quant_method, Int4LinearMethod)
    assert isinstance(layer.mlp.down_proj.quant_method, Int4LinearMethod)
    head = runner_of(engine).model.lm_head.quant_method  # the tied head: the Q8_0 embedding's codes
    assert isinstance(head, Int8LinearMethod) and head.takes_codes
    # float32 embedding (for lookups) 113 MB + int8 LM head 30 + int4 projections 66, of 540
    assert engine.weight_bytes < 0.42 * reference[3]
    # The same weights, summed in another order: the same greedy tokens, logprobs within noise.
    assert tokens == reference[1]
    assert agreement == 1.0 and mean_diff < 1e-3


def test_auto_default_reproduces_the_float_model_from_the_codes_alone(reference):
    """The default (--quantization auto) on the Q4_1 GGUF in float32: the GGUF's codes alone,
    multiplied at every row count (prompts and the 4 requests' decode steps), no float copy."""
    engine, tokens, mean_diff, agreement = _quantized(reference, dtype="float32")
    model = runner_of(engine).model
    for layer in (model.model.layers[0].self_attn.qkv_proj, model.lm_head):
        method = layer.quant_method
        assert isinstance(method, DualLinearMethod) and method.codes_only
        assert not hasattr(layer, "dense_weight")
    assert model.lm_head.quant_method.codes_method.bits == 8  # the Q8_0 embedding's codes
    # The float embedding (113 MB), the int4 codes (66 MB) and the head's int8 ones (30 MB), of
    # the float model's 540 MB.
    config = engine.model_config
    embedding = config.vocab_size * config.hidden_size * 4
    assert embedding < engine.weight_bytes < embedding + 0.2 * reference[3]
    assert tokens == reference[1]
    assert agreement == 1.0 and mean_diff < 1e-3


def test_int8_agrees_closely(reference):
    engine, tokens, mean_diff, agreement = _quantized(reference, quantization="int8")
    assert engine.dtype == FLOAT_DTYPES[auto_dtype("cpu")]
    assert isinstance(
        runner_of(engine).model.model.layers[0].self_attn.o_proj.quant_method, Int8LinearMethod
    )
    # The embedding in the engine's dtype (57 MB in bfloat16, 113 in float32), and about 1.07
    # bytes a weight (a float16 scale per 32 codes) for the int8 LM head 30 MB and projections
    # 113 MB, of 540 in float32.
    config = engine.model_config
    embedding = config.vocab_size * config.hidden_size * engine.dtype.itemsize
    assert engine.weight_bytes < embedding + 0.28 * reference[3]
    assert agreement >= 0.9 and mean_diff < 0.1, (agreement, mean_diff)


def test_int4_bfloat16_agrees_closely(reference):
    engine, tokens, mean_diff, agreement = _quantized(reference, quantization="int4")
    assert engine.dtype == FLOAT_DTYPES[auto_dtype("cpu")]
    assert agreement >= 0.9 and mean_diff < 0.1, (agreement, mean_diff)
