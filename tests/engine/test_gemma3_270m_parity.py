"""The real Gemma 3 270M (GGUF Q4_K_M, short name gemma3-270m) against transformers loading the
same file: greedy continuations identical, one prompt longer than the 512-token sliding window,
whole and in prefill chunks; the tokenizer rebuilt from the GGUF metadata identical to HF's."""

import pytest

from benchmarks.int8_accuracy import greedy_continuations, load_transformers
from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache_manager import NULL_BLOCK
from pagedllm.core.kv_cache_spec import cdiv
from pagedllm.model_loader import load_tokenizer

pytestmark = pytest.mark.slow

NUM_TOKENS = 24
SLIDING_WINDOW = 512
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "<start_of_turn>user\nName three colours of the rainbow.<end_of_turn>\n<start_of_turn>model\n",
    # Longer than the sliding window: the local layers must forget its beginning.
    "".join(f"Line {i}: the {i}th bottle of water stands on the wall.\n" for i in range(1, 50)),
]
TEXTS = [
    "Hello world",
    " leading space",
    "  two leading spaces",
    "trailing   ",
    "a  b   c    d     e",
    "tabs\tand\t\ttabs",
    "newlines\n\nand\n\n\nmore\n",
    "Mixed\r\nline endings\r",
    "digits 1234567890 3.14159 1,000,000",
    "emoji 😀🎉👩‍👩‍👧 ok",
    "日本語のテキスト、한국어 텍스트입니다.",
    "Ünïcödé façade naïve ﬁ Ǆ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "\u200bzero\u00a0width and nbsp",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos><pad> <unused0> <mask> [multimodal]",
    "code: def f(x):\n    return x**2  # comment\n",
    "",
    " ",
    "\n",
    "<0x41> ▁ literal pieces",
]


@pytest.fixture(scope="module")
def hf_gemma3():
    """transformers' own load of the GGUF (dequantized to float32) and its tokenizer."""
    return load_transformers("gemma3-270m")


@pytest.fixture(scope="module")
def prompts_and_expected(hf_gemma3):
    model, tokenizer = hf_gemma3
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    expected = [seq[n:] for n, seq in greedy_continuations(model, prompts, NUM_TOKENS)]
    assert len(prompts[-1]) > SLIDING_WINDOW + 64
    return prompts, expected


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", model="gemma3-270m", kv_cache_memory="256MiB", max_model_len=2048)


def test_config(llm):
    config = llm.llm_engine.model_config
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.sliding_window == SLIDING_WINDOW
    assert config.layer_types.count("full_attention") == 3 and len(config.layer_types) == 18
    assert 106 in llm.llm_engine.eos_token_ids  # <end_of_turn> ends a chat turn


def test_greedy_matches_transformers(llm, prompts_and_expected, hf_gemma3):
    prompts, expected = prompts_and_expected
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == expected
    # A text prompt goes through our tokenizer: the same ids, the same continuation and text.
    out = llm.generate(PROMPTS[-1], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompts[-1]
    assert out.outputs[0].token_ids == expected[-1]
    assert out.outputs[0].text == hf_gemma3[1].decode(expected[-1], skip_special_tokens=True)


def test_long_prompt_in_chunks_matches_transformers(prompts_and_expected):
    """Prefill in 100-token chunks with 32-token blocks: the sliding layers read the window
    across chunk and block boundaries, and their blocks that leave the window are released, so
    each sliding group's table stays within the window plus a chunk."""
    prompts, expected = prompts_and_expected
    llm = LLM(
        model="gemma3-270m", dtype="float32", kv_cache_memory="256MiB", max_model_len=2048,
        block_size=32,
        max_num_batched_tokens=100, enable_prefix_caching=False,
    )  # fmt: skip
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    assert [g.sliding_window for g in kv.groups] == [None] + [SLIDING_WINDOW] * 5  # 3 layers each
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    engine.add_request("long", {"prompt_token_ids": prompts[-1]}, params)
    bound = cdiv(SLIDING_WINDOW - 1 + 100, 32) + 1
    peak = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            token_ids = out.outputs[0].token_ids
        kv.check_integrity()
        peak = max(peak, kv.block_pool.num_blocks - kv.num_free_blocks)
        for group in kv.groups[1:]:
            for table in group.req_to_blocks.values():
                assert sum(b is not NULL_BLOCK for b in table) <= bound
    assert token_ids == expected[-1]
    num_full_blocks = cdiv(len(prompts[-1]) + NUM_TOKENS, 32)
    assert peak <= num_full_blocks + 5 * bound < 6 * num_full_blocks  # all layers: 6 tables


def test_tokenizer_matches_transformers(hf_gemma3):
    _, hf = hf_gemma3
    ours = load_tokenizer("gemma3-270m")
    assert ours.vocab_size == len(hf) == 262144
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    for text in TEXTS + PROMPTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], repr(text)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), repr(text)
    # Special tokens are never split, and decoding gives the text back (except a literal "▁",
    # which is how the vocabulary spells a space).
    assert ours.encode("<start_of_turn><end_of_turn>", add_special_tokens=False) == [105, 106]
    for text in (t for t in TEXTS if "▁" not in t):
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == text, repr(text)
