"""vLLM's extras through the real server: `prompt_logprobs` with the openai client, on
completions (per choice) and chat (per response), each prompt token's logprob equal to HF
transformers' log-softmax (float32), its rank, the k most likely beside it, None for the first
token; with echo + logprobs asking for more, the k asked for; above --max-logprobs a 400. And
`GET /tokenizer_info` as lm-evaluation-harness's remote tokenizer uses it with /tokenize and
/detokenize."""

from __future__ import annotations

import httpx
import jinja2
import openai
import pytest
import torch

from benchmarks.soak_targets import serve_in_thread
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from tests.conftest import save_tiny_llama

PROMPT = [(7 * i + 3) % 900 + 100 for i in range(21)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-49k-prompt-logprobs")
    model = save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    args = EngineArgs(model=str(path), tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      max_model_len=256, kv_cache_memory="16MiB")  # fmt: skip
    engine = AsyncLLMEngine(LLMEngine(args))
    try:
        with serve_in_thread(engine, "m") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            client.url = url
            yield client, model
    finally:
        engine.shutdown()


def _check(entries, prompt, model, k):
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        entry = {int(t): v for t, v in entries[p].items()}
        token = prompt[p]
        assert entry[token]["logprob"] == pytest.approx(ref[p - 1, token].item(), abs=1e-4)
        assert entry[token]["rank"] == int((ref[p - 1] > ref[p - 1, token]).sum()) + 1
        top = torch.topk(ref[p - 1], k).indices.tolist()
        assert set(entry) == {token, *top}
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())


def test_completions_and_chat_return_prompt_logprobs(served):
    client, model = served
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=2,
                                    extra_body={"prompt_logprobs": 3})  # fmt: skip
    _check(out.choices[0].model_extra["prompt_logprobs"], PROMPT, model, 3)
    # echo with logprobs=5 computes five; the response keeps the two asked for.
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, echo=True,
                                    logprobs=5, extra_body={"prompt_logprobs": 2})  # fmt: skip
    _check(out.choices[0].model_extra["prompt_logprobs"], PROMPT, model, 2)
    assert len(out.choices[0].logprobs.top_logprobs[1]) >= 5  # the echo keeps its five
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hello there"}], max_tokens=2,
        extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == chat.usage.prompt_tokens
    plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=2)
    assert plain.choices[0].model_extra.get("prompt_logprobs") is None


def test_too_many_prompt_logprobs_is_a_400(served):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=2,
                                  extra_body={"prompt_logprobs": 50})  # fmt: skip
    assert e.value.body["param"] == "prompt_logprobs"


def test_tokenizer_info_serves_a_remote_tokenizer(served):
    """What lm-eval's RemoteTokenizer does: eos / bos from /tokenizer_info, text through
    /tokenize and /detokenize, chats rendered with the served template."""
    client, _ = served
    info = httpx.get(f"{client.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 256
    tokens = httpx.post(
        f"{client.url}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}
    ).json()
    assert tokens["tokens"] == [info["eos_token_id"]]
    text = "Paged attention, in blocks."
    ids = httpx.post(
        f"{client.url}/tokenize", json={"prompt": text, "add_special_tokens": False}
    ).json()["tokens"]
    back = httpx.post(f"{client.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert back == text
    messages = [{"role": "user", "content": "Hi"}]
    rendered = (
        jinja2.Environment()
        .from_string(info["chat_template"])
        .render(messages=messages, add_generation_prompt=True, bos_token=info["bos_token"])
    )
    served_ids = httpx.post(f"{client.url}/tokenize", json={"messages": messages}).json()
    local_ids = httpx.post(
        f"{client.url}/tokenize", json={"prompt": rendered, "add_special_tokens": False}
    ).json()
    assert served_ids["tokens"] == local_ids["tokens"]


def test_priority_needs_the_priority_policy(served):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=2,
                                  extra_body={"priority": 3})  # fmt: skip
    assert "--scheduling-policy priority" in e.value.body["message"]
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=2,
                                    extra_body={"priority": 0})  # fmt: skip
    assert out.choices[0].finish_reason == "length"


def test_max_tokens_0_with_echo_scores_the_prompt(served):
    """The legacy API's scoring request (lm-eval style): the prompt echoed with its logprobs,
    no token generated or counted; without echo, or streamed, a 400."""
    client, model = served
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=1)  # fmt: skip
    choice = out.choices[0]
    lps = choice.logprobs
    assert len(lps.tokens) == len(PROMPT) and lps.token_logprobs[0] is None
    assert out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), -1)
    for p in range(1, len(PROMPT)):
        assert lps.token_logprobs[p] == pytest.approx(ref[p - 1, PROMPT[p]].item(), abs=1e-4)
    assert choice.text == "".join(lps.tokens)
    for bad in (dict(echo=False), dict(echo=True, stream=True)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="m", prompt=PROMPT, max_tokens=0, **bad)
        assert e.value.body["param"] == "max_tokens"
