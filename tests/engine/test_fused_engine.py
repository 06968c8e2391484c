"""The engine with the fused C++ decoder (the default on CPU) and with --enforce-eager on the
default model: the same tokens and log-probabilities, bit for bit, for a batch whose steps
mix prefill chunks with decode rows."""

import pytest

from pagedllm import LLM, SamplingParams, kernels
from tests.conftest import runner_of

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels"),
]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small"]


def _generate(quantization: str, enforce_eager: bool):
    llm = LLM(
        quantization=quantization, enforce_eager=enforce_eager, kv_cache_memory="128MiB",
        max_model_len=512, max_num_batched_tokens=512, enable_chunked_prefill=True,
    )  # fmt: skip
    assert (runner_of(llm.llm_engine).fused is None) == enforce_eager
    params = [SamplingParams(max_tokens=n, temperature=0, logprobs=3, ignore_eos=True)
              for n in (24, 5, 40)]  # fmt: skip
    # A long prompt joins while the others decode (its prefill steps go through the modules).
    prompts = [*PROMPTS, PROMPTS[2] * 30]
    outs = llm.generate(prompts, [*params, params[0]], use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_fused_decoder_gives_the_modules_tokens_and_logprobs(quantization):
    fused = _generate(quantization, enforce_eager=False)
    eager = _generate(quantization, enforce_eager=True)
    assert [len(t) for t, _ in fused] == [24, 5, 40, 24]
    assert fused == eager
