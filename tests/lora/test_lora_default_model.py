"""LoRA on the real default model (SmolLM2-135M-Instruct's GGUF): float32 greedy tokens and
logprobs equal HF transformers + peft on the same weights; with the default dtype and weights
(bfloat16 over the GGUF's codes), the adapter's rows run beside base rows and other adapters'
in one batch and give what each gives alone (--deterministic)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import ALL, hf_greedy, make_adapter

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
N = 12


@pytest.fixture(scope="module")
def adapters(hf_default_model, tmp_path_factory):
    model, tokenizer = hf_default_model
    root = tmp_path_factory.mktemp("default-lora")
    out = {}
    for name, targets, r in (("attn", ["q_proj", "k_proj", "v_proj", "o_proj"], 8),
                             ("all", ALL, 16)):  # fmt: skip
        peft_model = make_adapter(model, str(root / name), targets, r, r, seed=len(out))
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        out[name] = (str(root / name), prompts, [hf_greedy(peft_model, p, N) for p in prompts])
    return out


def test_float32_equals_peft(adapters):
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory="256MiB",
              max_model_len=512, enable_lora=True, max_loras=2)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=N, min_tokens=N, logprobs=0)
    for i, (name, (path, prompts, expected)) in enumerate(adapters.items()):
        lora = LoRARequest(name, i + 1, path)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=lora)  # fmt: skip
        for o, (tokens, logprobs) in zip(outs, expected, strict=True):
            c = o.outputs[0]
            assert c.token_ids == tokens, name
            ours = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
            assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < 1e-3


def test_default_dtype_and_codes_mixed_batch_equals_alone(adapters):
    llm = LLM(kv_cache_memory="256MiB", max_model_len=512, enable_lora=True, max_loras=2,
              deterministic=True)  # fmt: skip
    loras = [None] + [LoRARequest(n, i + 1, a[0]) for i, (n, a) in enumerate(adapters.items())]
    params = SamplingParams(temperature=0, max_tokens=N, min_tokens=N)
    prompts = [{"prompt_token_ids": p} for p in adapters["all"][1]]
    jobs = [(p, lora) for p in prompts for lora in loras]
    together = llm.generate([p for p, _ in jobs], params, use_tqdm=False,
                            lora_request=[lora for _, lora in jobs])  # fmt: skip
    alone = [llm.generate(p, params, use_tqdm=False, lora_request=lora)[0] for p, lora in jobs]
    tokens = [o.outputs[0].token_ids for o in together]
    assert tokens == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(t) for t in tokens[: len(loras)]}) == len(loras)  # each adapter differs
