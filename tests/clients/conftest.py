"""One served tiny model for every third-party client test in this directory: a random Llama with
SmolLM2's tokenizer (its 49152-token vocabulary), float32 so greedy answers and logprobs are
deterministic, behind the real HTTP server on loopback."""

from __future__ import annotations

import os
from dataclasses import dataclass

# The clients' libraries (huggingface_hub, transformers, datasets) read these when imported: set
# before any of them is, so nothing here can reach the network.
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("LANGSMITH_TRACING", "false")  # LangChain's tracing would post runs

import openai  # noqa: E402
import pytest  # noqa: E402

from benchmarks.soak_targets import serve_in_thread  # noqa: E402
from pagedllm.config import EngineArgs  # noqa: E402
from pagedllm.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402
from pagedllm.model_loader import load_tokenizer  # noqa: E402
from tests.conftest import save_tiny_llama  # noqa: E402


@dataclass
class Served:
    url: str  # the server's root, e.g. http://127.0.0.1:PORT
    model: str  # the served model name the clients ask for
    client: openai.OpenAI  # the reference answers come from OpenAI's own SDK
    hf_model: object  # the same weights in transformers, for reference logprobs
    tokenizer: object  # the tokenizer the server uses (pagedllm's)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-49k-clients")
    hf_model = save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    args = EngineArgs(model=str(path), tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      max_model_len=512, kv_cache_memory="32MiB")  # fmt: skip
    engine = AsyncLLMEngine(LLMEngine(args))
    try:
        with serve_in_thread(engine, "tiny") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            yield Served(url, "tiny", client, hf_model, load_tokenizer("SmolLM2-135M-Instruct"))
    finally:
        engine.shutdown()
