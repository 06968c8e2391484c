"""The engine's construction seams: a new engine on another's executor (its loaded model, a KV
pool for the new engine's cache settings), a block manager passed in, and the per-request state
the runner keeps and drops."""

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.engine.llm_engine import LLMEngine
from tests.conftest import runner_of, save_tiny_llama

PROMPTS = [[5, 9, 3], [17, 4, 88, 23, 6, 70, 11, 42, 9, 1, 66], list(range(10, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, seed=3)
    return str(path)


def args(path, **kwargs):
    return EngineArgs(model=path, dtype="float32", kv_cache_memory="4MiB", **kwargs)


def generate(engine, prompts=PROMPTS, params=GREEDY):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    engine.scheduler.check_integrity()
    return [list(done[str(i)].outputs[0].token_ids) for i in range(len(prompts))]


def test_an_engine_on_another_engines_executor_runs_its_model_with_its_own_block_size(tiny):
    first = LLMEngine(args(tiny, block_size=16))
    num_blocks = first.num_blocks
    expected = generate(LLMEngine(args(tiny, block_size=4)))
    executor = first.executor
    model = executor.driver_worker.model
    second = LLMEngine(args(tiny, block_size=4), executor=executor)
    assert second.executor is executor and executor.driver_worker.model is model  # not reloaded
    assert runner_of(second).block_size == 4 and second.kv_cache_spec.block_size == 4
    # The same bytes in blocks a quarter the size: four times as many.
    assert second.num_blocks == 4 * num_blocks
    assert generate(second) == expected
    with pytest.raises(RuntimeError, match="took this engine's executor over"):
        first.step()


def test_the_pool_is_kept_when_only_the_block_manager_differs(tiny):
    first = LLMEngine(args(tiny))
    pool = runner_of(first).kv_cache.pool
    second = LLMEngine(args(tiny, enable_prefix_caching=False), executor=first.executor)
    assert runner_of(second).kv_cache.pool is pool
    assert generate(second) == generate(LLMEngine(args(tiny)))


def test_an_executor_runs_only_the_model_it_loaded(tiny, tmp_path):
    other = tmp_path / "other"
    save_tiny_llama(other, seed=4, num_hidden_layers=3)
    first = LLMEngine(args(tiny))
    with pytest.raises(ValueError, match="model configs differ"):
        LLMEngine(args(str(other)), executor=first.executor)


def test_the_block_manager_is_the_factorys(tiny):
    made = []

    def factory(config, num_blocks, num_cpu_blocks, windows):
        made.append((num_blocks, num_cpu_blocks, windows))
        return KVCacheManager(num_blocks, config.cache.block_size, False, num_cpu_blocks, windows)

    engine = LLMEngine(args(tiny), kv_cache_manager=factory)
    assert made == [(engine.num_blocks, 0, [None])]
    assert not engine.scheduler.kv_cache_manager.enable_prefix_caching
    assert generate(engine) == generate(LLMEngine(args(tiny)))


def _samples(engine, request_id, prompt, params):
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    done = None
    while engine.has_unfinished_requests():
        done = next((o for o in engine.step() if o.finished), done)
    return [list(c.token_ids) for c in done.outputs]


def test_the_runner_keeps_a_requests_generators_until_it_finishes(tiny):
    engine = LLMEngine(args(tiny))
    runner = runner_of(engine)
    seeded = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=4, ignore_eos=True)
    engine.add_request("s", {"prompt_token_ids": PROMPTS[0]}, seeded)
    engine.step()
    assert set(runner.step_sampler.generators["s"]) == {0, 1}  # one per sample, kept across steps
    while engine.has_unfinished_requests():
        engine.step()
    assert "s" not in engine.scheduler.requests
    assert "s" in runner.step_sampler.generators  # the runner hears of it with the next step
    engine.add_request("next", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    engine.step()
    assert "s" not in runner.step_sampler.generators
    engine.abort_request("next")


def test_a_reused_request_id_draws_fresh_seeded_streams(tiny):
    """Even when the new request comes in the very step that reports the old one finished."""
    seeded = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=6, ignore_eos=True)
    engine = LLMEngine(args(tiny))
    once = _samples(engine, "s", PROMPTS[0], seeded)
    assert _samples(engine, "s", PROMPTS[0], seeded) == once
    assert _samples(LLMEngine(args(tiny)), "s", PROMPTS[0], seeded) == once
