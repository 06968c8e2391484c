"""Structured outputs in the engine with the real default model: every kind of constraint holds,
samples fork their grammar state, preemption keeps it, and unconstrained requests batched with
constrained ones decode exactly as they do alone."""

import json
import re

import jsonschema
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sample.grammar_mask import apply_grammar_bitmask
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {
            "type": "array",
            "items": {"enum": ["cat", "dog", "fish"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "pets", "address"],
    "additionalProperties": False,
}
CHOICES = ["Paris", "London", "a person in Paris"]
GBNF = 'root ::= "Alice is " [0-9]+ " years old."'  # llama.cpp's grammar format
LARK = 'start: "Alice likes " ANIMAL\nANIMAL: "cats" | "dogs"'  # llguidance's
ASK = "Describe a person called Alice who lives in Paris, as JSON."


def fullmatch(pattern):
    return re.compile(pattern).fullmatch


def valid(text, schema) -> bool:
    jsonschema.validate(json.loads(text), schema)
    return True


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def chat_prompt(llm, text):
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return {"prompt_token_ids": tokenizer.encode(rendered, add_special_tokens=False)}


def constrained(max_tokens=120, **kind):
    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**kind),
    )


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)


def check_pool(llm):
    engine = llm.llm_engine
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_apply_grammar_bitmask_masks_exactly_the_cleared_bits():
    torch.manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(4, vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32)
    bitmask[0, 0] = -(2**31)  # only bit 31 (the sign bit) of the first word set
    rows = torch.tensor([3, 1])
    out = logits.clone()
    apply_grammar_bitmask(out, rows, bitmask)
    for r, row in enumerate(rows.tolist()):
        for t in range(vocab):
            allowed = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert out[row, t] == (logits[row, t] if allowed else float("-inf"))
    assert torch.equal(out[[0, 2]], logits[[0, 2]])  # unconstrained rows untouched


@pytest.mark.slow
def test_each_kind_of_constraint_holds(llm):
    ask_city = "Return a JSON object with the keys city and country for Paris."
    cases = [  # (question, constraint, the output's check)
        (ASK, dict(json=PERSON), lambda t: valid(t, PERSON)),
        (
            ASK,
            dict(json=json.dumps(PERSON), disable_any_whitespace=True),
            lambda t: valid(t, PERSON) and t == compact(json.loads(t)),
        ),
        (ask_city, dict(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (ASK, dict(regex=r"[A-Z][a-z]+, \d{2} years"), fullmatch(r"[A-Z][a-z]+, [0-9]{2} years")),
        (ASK, dict(choice=CHOICES), lambda t: t in CHOICES),
        (ASK, dict(grammar=GBNF), fullmatch(r"Alice is [0-9]+ years old\.")),
        (ASK, dict(grammar=LARK), fullmatch(r"Alice likes (cats|dogs)")),
    ]
    prompts = [chat_prompt(llm, question) for question, _, _ in cases]
    params = [constrained(**kind) for _, kind, _ in cases]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for (_, kind, check), out in zip(cases, outputs, strict=True):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (kind, text)
        assert check(text), (kind, text)
    check_pool(llm)


@pytest.mark.slow
def test_a_cut_output_is_a_prefix_with_finish_reason_length(llm):
    prompt = chat_prompt(llm, ASK)
    full = llm.generate(prompt, constrained(json=PERSON), use_tqdm=False)[0].outputs[0]
    cut = llm.generate(prompt, constrained(5, json=PERSON), use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "stop" and cut.finish_reason == "length"
    assert cut.token_ids == full.token_ids[:5]
    assert full.text.startswith(cut.text)


@pytest.mark.slow
def test_samples_fork_their_grammar_state(llm):
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=7,
        max_tokens=160,
        structured_outputs=StructuredOutputsParams(json=PERSON),
    )
    out = llm.generate(chat_prompt(llm, ASK), params, use_tqdm=False)[0]
    assert len({o.text for o in out.outputs}) > 1  # the samples differ...
    for o in out.outputs:  # ...and each one validates: a shared matcher would break this
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    check_pool(llm)


@pytest.mark.slow
def test_unconstrained_requests_decode_the_same_beside_constrained_ones(llm):
    questions = ["What is the capital of France?", "List three prime numbers.", ASK]
    prompts = [chat_prompt(llm, q) for q in questions]
    greedy = SamplingParams(temperature=0, max_tokens=48, min_tokens=48)
    alone = llm.generate(prompts, greedy, use_tqdm=False)
    mixed = llm.generate(
        prompts + prompts,
        [greedy] * 3 + [constrained(json=PERSON), constrained(regex=r"\d+"), greedy],
        use_tqdm=False,
    )
    for a, m in zip(alone, mixed[:3], strict=True):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
    # The constrained ones were really constrained, in the same batch.
    jsonschema.validate(json.loads(mixed[3].outputs[0].text), PERSON)
    assert re.fullmatch(r"[0-9]+", mixed[4].outputs[0].text)
    assert mixed[5].outputs[0].token_ids == alone[2].outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_resume_their_grammar(mode):
    # ~16 blocks of 16 tokens for 6 requests of ~150 tokens: preemption is certain.
    llm = LLM(
        dtype="float32",
        kv_cache_memory="12MiB",
        max_model_len=256,
        preemption_mode=mode,
        swap_space=0.5 if mode == "swap" else 0,
    )
    names = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank"]
    prompts = [chat_prompt(llm, ASK.replace("Alice", name)) for name in names]
    params = [constrained(json=PERSON), constrained(regex=r"(Alice|Bob) [a-z ]{10,40}\.")] * 3
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats()["num_preemptions_total"] > 0
    for out in outputs[0::2]:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    for out in outputs[1::2]:
        assert re.fullmatch(r"(Alice|Bob) [a-z ]{10,40}\.", out.outputs[0].text)
    check_pool(llm)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, message",
    [
        (dict(json={"type": "objectx"}), "invalid json for structured outputs"),
        (dict(regex="a(b"), "invalid regex for structured outputs"),
        (dict(grammar="start: undefined_rule"), "invalid grammar for structured outputs"),
        # Compile, but their language is empty: the first token would have nowhere to go.
        (dict(grammar="start: start"), "grammar for structured outputs admits no output"),
        (dict(json={"$ref": "#"}), "json for structured outputs admits no output"),
    ],
)
def test_a_bad_constraint_is_refused_at_admission(llm, kind, message):
    with pytest.raises(ValueError, match=message):
        llm.llm_engine.add_request("bad", chat_prompt(llm, ASK), constrained(**kind))
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(chat_prompt(llm, ASK), constrained(choice=["yes", "no"]), use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")
    check_pool(llm)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        ({"json": {}, "regex": "a"}, "exactly one of"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "[1, 2]"}, "schema object"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", 3]}, "non-empty list"),
        ({"regex": ""}, "non-empty string"),
    ],
)
def test_bad_structured_outputs_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_beam_search_is_refused_with_structured_outputs():
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(
            use_beam_search=True,
            temperature=0,
            n=2,
            structured_outputs=StructuredOutputsParams(regex="a+"),
        )


def test_sampler_only_draws_allowed_tokens():
    """Random and greedy rows of one batch, each with a different allowed set."""
    from pagedllm.sample.metadata import SamplingMetadata

    vocab = 100
    logits = torch.randn(3, vocab)
    allowed = [{5, 64, 99}, {31}, set(range(vocab))]
    bitmask = torch.zeros(3, 4, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    base = SamplingMetadata.from_requests([], vocab, "cpu")
    for temperature in (0.0, 1.0):
        md = SamplingMetadata(
            **{
                **base.__dict__,
                "temperature": None if temperature == 0 else torch.ones(3),
                "all_greedy": temperature == 0,
                "all_random": temperature != 0,
                "grammar_bitmask": (torch.tensor([0, 1]), bitmask[:2]),
                "num_logprobs": [None] * 3,
            }
        )
        for _ in range(20):
            sampled = Sampler(seed=1)(logits, md).sampled_token_ids.tolist()
            assert sampled[0] in allowed[0] and sampled[1] == 31
        if temperature == 0:
            assert sampled[2] == int(logits[2].argmax())  # the unconstrained row is unchanged


@pytest.mark.slow
def test_ignore_eos_keeps_an_open_grammar_going(llm):
    # "[a-z ]+" accepts at every step: EOS is allowed there, and the model takes it early
    # unless ignore_eos masks it (the grammar would otherwise consume it as its end).
    prompts = [chat_prompt(llm, q) for q in ("What do cats like?", "Tell me about the sea.")]
    params = SamplingParams(
        temperature=0,
        max_tokens=48,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(regex="[a-z ]+"),
    )
    for out in llm.generate(prompts, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == 48
        assert re.fullmatch("[a-z ]+", out.outputs[0].text)


@pytest.mark.parametrize("depth", [200, 20_000])
def test_a_deeply_nested_schema_is_an_error_not_a_crash(depth):
    # Handed to llguidance as a dict, 10,000 levels overflowed its native stack (a segfault).
    from pagedllm.structured_output import _grammar_text, json_schema_error

    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    assert json_schema_error(schema)  # a message
    with pytest.raises(ValueError):
        _grammar_text(StructuredOutputsParams(json=schema))
