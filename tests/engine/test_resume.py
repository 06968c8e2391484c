"""A request resumed on a new engine with the output a lost engine had handed out (what the
engine process's client does after a crash): its outputs go on exactly as an undisturbed run's,
for greedy and seeded sampling, penalties, stop strings, logprobs and structured outputs."""

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import ResumedOutput
from pagedllm.sampling_params import StructuredOutputsParams
from tests.conftest import save_tiny_llama


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-resume")
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    args = EngineArgs(model=str(path), tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      block_size=4, kv_cache_memory="16MiB")  # fmt: skip
    return LLMEngine(args)


def run(engine, request_id, prompt, params, resumed=None):
    """Every delta output's (text, token ids, logprobs) until the request finishes."""
    engine.add_request(request_id, prompt, params, delta=True, resumed=resumed)
    deltas = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            (c,) = output.outputs
            deltas.append((c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason))
    return deltas


def joined(deltas):
    text = "".join(d[0] for d in deltas)
    tokens = [t for d in deltas for t in d[1]]
    logprobs = [lp for d in deltas for lp in (d[2] or [])]
    return text, tokens, logprobs, deltas[-1][3], deltas[-1][4]


PROMPT = "The capital of France is"
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
    "penalties": SamplingParams(
        temperature=0.8,
        seed=3,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        max_tokens=24,
        ignore_eos=True,
        logprobs=3,
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("cut", [1, 9])
def test_a_resumed_request_goes_on_as_an_undisturbed_one(engine, name, cut):
    params = CASES[name]
    whole = run(engine, f"{name}-{cut}-whole", PROMPT, params)
    text, tokens, logprobs, cumulative, reason = joined(whole)
    # The lost engine handed out the first `cut` deltas.
    before = joined(whole[:cut])
    resumed = ResumedOutput(before[1], whole[cut - 1][3] or 0.0)
    after = run(engine, f"{name}-{cut}-resumed", PROMPT, params, resumed)
    assert before[1] + joined(after)[1] == tokens
    assert before[0] + joined(after)[0] == text
    if params.logprobs is not None:
        assert before[2] + joined(after)[2] == logprobs
        assert joined(after)[3] == pytest.approx(cumulative, rel=1e-5)
    assert joined(after)[4] == reason
    assert engine.scheduler.kv_cache_manager.usage == 0


def test_a_stop_string_spanning_the_cut_and_held_back_text_are_kept(engine):
    """Text held back (it could start a stop string) when the engine was lost is handed out
    by the new one; a stop string that began before the cut still ends the output."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = joined(run(engine, "probe", PROMPT, greedy))[0]
    stop = text[len(text) // 2 : len(text) // 2 + 4]  # a stop string the output contains
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    whole = run(engine, "stop-whole", PROMPT, params)
    for cut in range(1, len(whole), 3):
        before = joined(whole[:cut])
        resumed = ResumedOutput(before[1])
        after = joined(run(engine, f"stop-{cut}", PROMPT, params, resumed))
        assert before[0] + after[0] == joined(whole)[0]
        assert after[4] == "stop"


def test_a_structured_output_resumes_inside_its_grammar(engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(json=schema))  # fmt: skip
    whole = run(engine, "json-whole", PROMPT, params)
    before = joined(whole[:3])
    after = run(engine, "json-resumed", PROMPT, params, ResumedOutput(before[1]))
    assert before[0] + joined(after)[0] == joined(whole)[0]


def test_only_single_sequence_requests_resume(engine):
    for params in (SamplingParams(n=2, max_tokens=4), SamplingParams(best_of=2, max_tokens=4)):
        with pytest.raises(ValueError, match="one sequence"):
            engine.add_request("many", PROMPT, params, resumed=ResumedOutput([5]))
    assert not engine.has_unfinished_requests()
