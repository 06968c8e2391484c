"""lm-evaluation-harness's local-completions model against /v1/completions, tokenizing through the
server (tokenizer_backend="remote": /tokenizer_info, /tokenize, /detokenize). lm-eval scores a
continuation by sending context + continuation as token ids with echo, logprobs=1 and
max_tokens=1, and summing the echoed prompt's logprobs past the context; is_greedy is each token
being its position's top logprob. Those equal transformers' log-softmax on the same weights
(float32) and its argmax; generate_until equals the endpoint's greedy text under the same stop
strings. Then a whole evaluation of two tasks whose YAML and data live in data/ (read from disk,
never from the hub)."""

from __future__ import annotations

from pathlib import Path

import lm_eval
import pytest
import torch
import yaml
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

DATA = Path(__file__).parent / "data"


def _lm(served, **kwargs) -> LocalCompletionsAPI:
    kwargs = {"tokenizer_backend": "remote", "max_length": 512, "max_retries": 1, **kwargs}
    return LocalCompletionsAPI(
        base_url=f"{served.url}/v1/completions", model=served.model, **kwargs
    )


@pytest.fixture(scope="module")
def lm(served):
    return _lm(served)


def _tokens(served, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: the continuation is what encoding the whole adds to the context's ids;
    an empty context is the BOS token."""
    tokenizer = served.tokenizer
    if not context:
        return [tokenizer.bos_token_id], tokenizer.encode(continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, tokenizer.encode(context + continuation, add_special_tokens=False)[len(ctx) :]


def _reference(served, context: str, continuation: str) -> tuple[float, bool]:
    """transformers' log P(continuation | context) and whether greedy decoding would give it."""
    ctx, cont = _tokens(served, context, continuation)
    with torch.no_grad():
        logits = served.hf_model(torch.tensor([ctx + cont])).logits[0].float()
    rows = torch.log_softmax(logits, -1)[len(ctx) - 1 : -1]
    target = torch.tensor(cont)
    return rows[torch.arange(len(cont)), target].sum().item(), bool(
        (rows.argmax(-1) == target).all()
    )


def _greedy_continuation(served, context: str, steps: int) -> str:
    ids = served.tokenizer.encode(context, add_special_tokens=False)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(served.hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return served.tokenizer.decode(ids[-steps:], skip_special_tokens=False)


def _instances(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, args, i) for i, args in enumerate(arguments)]


def test_loglikelihood_matches_transformers(served, lm):
    context = "The capital of France is"
    greedy = _greedy_continuation(served, context, 3)
    ctx, cont = _tokens(served, context, greedy)
    assert len(cont) == 3  # the greedy tokens encode back to themselves: is_greedy must hold
    requests = [(context, greedy), (context, " Paris"),
                ("Question: Which gas do plants take in?\nAnswer:", " carbon dioxide"),
                ("", "Hello world")]  # fmt: skip
    expected = [_reference(served, *args) for args in requests]
    assert expected[0][1] and not expected[1][1]  # both branches of is_greedy are checked
    results = lm.loglikelihood(_instances("loglikelihood", requests))
    for (logprob, is_greedy), (ref_logprob, ref_greedy) in zip(results, expected, strict=True):
        assert logprob == pytest.approx(ref_logprob, abs=1e-3) and is_greedy == ref_greedy
    # Several token-id prompts per request (the choices in order), requests in flight at once
    # (lm-eval's aiohttp path), and "auto" finding the remote tokenizer endpoints itself.
    batched_lm = _lm(served, batch_size=2, num_concurrent=2, tokenizer_backend="auto")
    assert batched_lm.tokenizer_backend == "remote"
    batched = batched_lm.loglikelihood(_instances("loglikelihood", requests))
    assert [g for _, g in batched] == [g for _, g in results]
    assert [lp for lp, _ in batched] == pytest.approx([lp for lp, _ in results], abs=1e-4)


def test_generate_until_matches_the_completions_endpoint(served, lm):
    context = "Once upon a time"
    ids = served.tokenizer.encode(context, add_special_tokens=False)

    def endpoint(stop: list[str]) -> str:
        out = served.client.completions.create(
            model=served.model, prompt=ids, max_tokens=16, temperature=0, stop=stop
        )
        return out.choices[0].text

    eos = served.tokenizer.eos_token  # lm-eval adds the EOS text to the stop strings
    free = endpoint([eos])
    assert len(free) >= 8
    stop = free[len(free) // 2 : len(free) // 2 + 2]  # a stop string the greedy text reaches
    cut = endpoint([stop, eos])
    assert cut == free[: free.index(stop)]
    texts = lm.generate_until(
        _instances("generate_until", [(context, {"until": [stop], "max_gen_toks": 16}),
                                      (context, {"until": ["@@@@"], "max_gen_toks": 16})])
    )  # fmt: skip
    assert texts == [cut, free]


def _task(name: str, cache_dir: Path) -> dict:
    """A task YAML from data/, its data files made absolute and its datasets cache a temporary
    directory (so the run reads only the checkout and writes only under tmp)."""
    config = yaml.safe_load((DATA / f"{name}.yaml").read_text())
    kwargs = config["dataset_kwargs"]
    kwargs["data_files"] = {split: str(DATA / f) for split, f in kwargs["data_files"].items()}
    kwargs["cache_dir"] = str(cache_dir)
    return config


def test_simple_evaluate_on_local_tasks(served, lm, tmp_path):
    tasks = [_task("tiny_mc", tmp_path), _task("tiny_gen", tmp_path)]
    out = lm_eval.simple_evaluate(lm, tasks=tasks, log_samples=True, bootstrap_iters=0)
    mc, gen = out["samples"]["pagedllm_tiny_mc"], out["samples"]["pagedllm_tiny_gen"]
    assert len(mc) == 3 and len(gen) == 2
    correct = []
    for sample in mc:
        expected = [_reference(served, *args) for args in sample["arguments"]]
        scores = [logprob for logprob, _ in sample["filtered_resps"]]
        assert scores == pytest.approx([logprob for logprob, _ in expected], abs=1e-3)
        assert [g for _, g in sample["filtered_resps"]] == [g for _, g in expected]
        best = max(range(len(scores)), key=scores.__getitem__)
        correct.append(best == int(sample["target"]))
    assert out["results"]["pagedllm_tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / 3)
    eos = served.tokenizer.eos_token
    for sample in gen:
        context, gen_kwargs = sample["arguments"][0]
        ids = served.tokenizer.encode(context, add_special_tokens=False)
        ref = served.client.completions.create(
            model=served.model, prompt=ids, temperature=0, max_tokens=gen_kwargs["max_gen_toks"],
            stop=[*gen_kwargs["until"], eos],
        )  # fmt: skip
        assert sample["filtered_resps"][0] == ref.choices[0].text
    matches = [s["filtered_resps"][0] == s["target"] for s in gen]
    assert out["results"]["pagedllm_tiny_gen"]["exact_match,none"] == sum(matches) / 2
