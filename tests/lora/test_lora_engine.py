"""Multi-LoRA in the engine against HF transformers + peft (float32, tiny random Llama): each
adapter's greedy tokens and logprobs equal peft's, for several target sets, ranks and scalings;
a batch mixing the base model and several adapters equals each run alone, also with fewer slots
than adapters (slots churn) and under preemption; two adapters never share prefix-cached K/V."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import save_file

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import ALL, hf_greedy, make_adapter

PROMPTS = [[5, 9, 3, 17, 4, 88], [100, 7, 7, 23], list(range(10, 40)), [64, 1, 2]]
N = 12
# (targets, rank, alpha, extra LoraConfig): attention only, MLP only, all, rsLoRA, patterns
ADAPTERS = [
    (["q_proj", "v_proj"], 8, 16, {}),
    (["gate_proj", "up_proj", "down_proj"], 4, 8, {}),
    (ALL, 16, 32, {}),
    (["k_proj", "o_proj", "down_proj"], 8, 4, {"use_rslora": True}),
    (ALL, 8, 16, {"rank_pattern": {"o_proj": 4}, "alpha_pattern": {"down_proj": 64}}),
]


@pytest.fixture(scope="module")
def adapters(tiny_base, tmp_path_factory):
    """Each adapter's path and peft's greedy tokens / logprobs per prompt; the base's too."""
    path, base = tiny_base
    root = tmp_path_factory.mktemp("adapters")
    out = {None: (None, [hf_greedy(base, p, N) for p in PROMPTS])}
    for i, (targets, r, alpha, extra) in enumerate(ADAPTERS):
        adapter_path = str(root / f"a{i}")
        model = make_adapter(base, adapter_path, targets, r, alpha, seed=10 + i, **extra)
        out[i] = (adapter_path, [hf_greedy(model, p, N) for p in PROMPTS])
    return out


def _request(adapters, i):
    return None if i is None else LoRARequest(f"a{i}", i + 1, adapters[i][0])


def _run(llm, adapters, jobs):
    """jobs: (prompt index, adapter index) pairs, all in one generate call."""
    params = SamplingParams(temperature=0, max_tokens=N, min_tokens=N, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[p]} for p, _ in jobs], params,
                        use_tqdm=False,
                        lora_request=[_request(adapters, a) for _, a in jobs])  # fmt: skip
    engine = llm.llm_engine
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_blocks
    results = []
    for o in outs:
        c = o.outputs[0]
        results.append((c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids,
                                                                      strict=True)]))  # fmt: skip
    return results


def _check(results, adapters, jobs):
    for (tokens, logprobs), (p, a) in zip(results, jobs, strict=True):
        want_tokens, want_logprobs = adapters[a][1][p]
        assert tokens == want_tokens, (p, a)
        assert max(abs(x - y) for x, y in zip(logprobs, want_logprobs, strict=True)) < 1e-4


def _llm(path, **kwargs):
    kwargs = {"kv_cache_memory": "8MiB", "max_loras": 2, "max_lora_rank": 16, **kwargs}
    return LLM(model=path, dtype="float32", enable_lora=True, **kwargs)


def test_each_adapter_alone_equals_peft(tiny_base, adapters):
    llm = _llm(tiny_base[0])
    for a in range(len(ADAPTERS)):
        jobs = [(p, a) for p in range(len(PROMPTS))]
        _check(_run(llm, adapters, jobs), adapters, jobs)
    differs = [adapters[a][1][0][0] != adapters[None][1][0][0] for a in range(len(ADAPTERS))]
    assert all(differs), "an adapter that leaves the tokens alone tests nothing"


@pytest.mark.parametrize("max_loras", [4, 2])
def test_mixed_batch_equals_each_alone(tiny_base, adapters, max_loras):
    """Base + 4 adapters interleaved in one batch; with 2 slots the scheduler admits what fits
    and the slots churn between adapters."""
    llm = _llm(tiny_base[0], max_loras=max_loras, max_cpu_loras=max_loras + 1)
    jobs = [(p, a) for p in range(len(PROMPTS)) for a in (None, 0, 2, 3, 1)]
    _check(_run(llm, adapters, jobs), adapters, jobs)


def test_preemption_and_chunked_prefill_with_adapters(tiny_base, adapters):
    llm = _llm(tiny_base[0], block_size=1, num_gpu_blocks_override=90, max_model_len=80,
               max_num_batched_tokens=80)  # fmt: skip
    jobs = [(p, a) for p in (2, 0, 1, 2) for a in (4, 0)]
    _check(_run(llm, adapters, jobs), adapters, jobs)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


def test_adapters_never_share_prefix_cached_blocks(tiny_base, adapters):
    llm = _llm(tiny_base[0], block_size=4)
    manager = llm.llm_engine.scheduler.kv_cache_manager
    jobs = [(2, 0)]
    _check(_run(llm, adapters, jobs), adapters, jobs)
    hits = manager.prefix_cache_hits
    for a in (2, None, 0):  # another adapter, the base, then the first adapter again
        _check(_run(llm, adapters, [(2, a)]), adapters, [(2, a)])
    assert manager.prefix_cache_hits > hits  # the first adapter's blocks, found again


def test_n_and_seeded_sampling_follow_the_adapter(tiny_base, adapters):
    llm = _llm(tiny_base[0])
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    lora = _request(adapters, 2)
    together = llm.generate([prompt, prompt], params, use_tqdm=False, lora_request=[lora, None])
    alone = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
    base = llm.generate(prompt, params, use_tqdm=False)[0]
    tokens = [[c.token_ids for c in o.outputs] for o in (*together, alone, base)]
    assert tokens[0] == tokens[2] and tokens[1] == tokens[3] and tokens[0] != tokens[1]


def _write_adapter(path, tensors, config=None):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **(config or {})}, f)
    if tensors is not None:
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))


def test_bad_adapters_are_refused_clearly(tiny_base, adapters, tmp_path):
    import torch

    llm = _llm(tiny_base[0], max_lora_rank=8)
    prefix = "base_model.model.model.layers.0"
    cases = {
        "above --max-lora-rank 8": adapters[2][0],  # rank 16
        "no adapter_model.safetensors": None,
        "has no module model.layers.0.mlp.fc1": {
            f"{prefix}.mlp.fc1.lora_A.weight": torch.zeros(4, 64),
            f"{prefix}.mlp.fc1.lora_B.weight": torch.zeros(128, 4),
        },
        "embedding / LM-head LoRA is not supported": {
            "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 128),
        },
        "do not fit": {
            f"{prefix}.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
            f"{prefix}.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
        },
        "no such adapter": str(tmp_path / "missing"),
    }
    for i, (message, spec) in enumerate(cases.items()):
        if spec is None or isinstance(spec, dict):
            path = str(tmp_path / f"bad{i}")
            _write_adapter(path, spec)
        else:
            path = spec
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt_token_ids": [5, 6]}, use_tqdm=False,
                         lora_request=LoRARequest("bad", 100 + i, path))  # fmt: skip
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_blocks
    # The engine still serves adapters and the base model.
    _check(_run(llm, adapters, [(0, 0), (0, None)]), adapters, [(0, 0), (0, None)])


def test_lora_needs_enable_lora(tiny_base, adapters):
    llm = LLM(model=tiny_base[0], dtype="float32", kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate({"prompt_token_ids": [5]}, use_tqdm=False,
                     lora_request=_request(adapters, 0))  # fmt: skip


def test_tensor_parallel_adapters_equal_peft(tiny_base, adapters):
    """Two ranks: A cut like the base weight's input for o_proj / down_proj, B like its output
    for the column-parallel ones; slots filled on both ranks as rank 0 plans them."""
    llm = _llm(tiny_base[0], tensor_parallel_size=2)
    try:
        jobs = [(p, a) for p in (0, 2) for a in (None, 2, 4, 1)]
        _check(_run(llm, adapters, jobs), adapters, jobs)
    finally:
        llm.shutdown()


def test_beam_search_with_an_adapter_equals_peft(tiny_base, adapters, tmp_path):
    from pagedllm import BeamSearchParams
    from tests.engine.test_beam_search_parity import assert_matches_hf, hf_beam_search

    path, base = tiny_base
    model = make_adapter(base, str(tmp_path / "beam"), ALL, 8, 16, seed=10 + 2)
    prompts = [PROMPTS[0], PROMPTS[3]]
    expected = [hf_beam_search(model, p, beam_width=3, max_tokens=10, length_penalty=1.0,
                               early_stopping=False, eos=[2], pad=0) for p in prompts]  # fmt: skip
    llm = _llm(path)
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    lora = LoRARequest("beam", 99, str(tmp_path / "beam"))
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params,
                              lora_request=lora)  # fmt: skip
    assert_matches_hf(results, prompts, expected, 1.0)


def test_structured_output_with_an_adapter(adapters, tmp_path):
    """A grammar constrains an adapter's tokens as the base model's (tokenizer: the default
    model's, on a tiny model of its vocabulary)."""
    from tests.conftest import save_tiny_llama

    base = save_tiny_llama(tmp_path / "base", vocab_size=49152, max_position_embeddings=512)
    make_adapter(base, str(tmp_path / "a"), ALL, 8, 16)
    llm = LLM(model=str(tmp_path / "base"), tokenizer="SmolLM2-135M-Instruct", dtype="float32",
              kv_cache_memory="16MiB", max_model_len=256, enable_lora=True)  # fmt: skip
    from pagedllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[a-d]{6}")
    )
    outs = llm.generate(
        ["x", "x"],
        params,
        use_tqdm=False,
        lora_request=[LoRARequest("a", 1, str(tmp_path / "a")), None],
    )
    texts = [o.outputs[0].text for o in outs]
    assert all(len(t) == 6 and set(t) <= set("abcd") for t in texts), texts


def test_gguf_lora_file_equals_its_peft_adapter(tiny_base, adapters, tmp_path):
    """The same adapter as llama.cpp's converter writes it (q/k rows of B permuted) gives the
    PEFT adapter's tokens."""
    from safetensors.torch import load_file

    from tests.model_loader.test_gguf_lora import write_lora

    path, _ = tiny_base
    llm = _llm(path)
    for a in (0, 2):
        tensors = load_file(os.path.join(adapters[a][0], "adapter_model.safetensors"))
        gguf_path = write_lora(tmp_path / f"a{a}.gguf", tensors, alpha=ADAPTERS[a][2])
        lora = LoRARequest(f"g{a}", 50 + a, gguf_path)
        params = SamplingParams(temperature=0, max_tokens=N, min_tokens=N)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                            lora_request=lora)  # fmt: skip
        assert [o.outputs[0].token_ids for o in outs] == [t for t, _ in adapters[a][1]]


def test_an_adapter_gone_before_its_step_fails_its_requests_alone(tiny_base, adapters, tmp_path):
    """Checked when added, deleted before the step that needs it: its requests end with an
    error, the others (base, another adapter) give peft's tokens, every block comes back."""
    import shutil

    path, _ = tiny_base
    llm = _llm(path)
    engine = llm.llm_engine
    doomed = str(tmp_path / "doomed")
    shutil.copytree(adapters[1][0], doomed)
    params = SamplingParams(temperature=0, max_tokens=N, min_tokens=N)
    jobs = {"a0": _request(adapters, 0), "gone": LoRARequest("gone", 77, doomed), "base": None}
    for name, lora in jobs.items():
        engine.add_request(name, {"prompt_token_ids": PROMPTS[0]}, params, lora_request=lora)
    shutil.rmtree(doomed)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["gone"].error is not None and "gone" in finals["gone"].error
    assert finals["a0"].outputs[0].token_ids == adapters[0][1][0][0]
    assert finals["base"].outputs[0].token_ids == adapters[None][1][0][0]
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_blocks
