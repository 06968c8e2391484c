"""`pagedllm bench lora` on a tiny random model (structure only, never timings): the random
adapters it writes load and change the tokens, every run is reported with its ratio to the base
model, and with fewer slots than adapters the scheduler's churn shows as more steps."""

from __future__ import annotations

import json

from pagedllm.bench import lora
from pagedllm.entrypoints.cli import build_parser, engine_args_from
from tests.conftest import save_tiny_llama


def test_the_whole_command_on_a_tiny_model(tmp_path, capsys):
    save_tiny_llama(tmp_path / "m", max_position_embeddings=512)
    out = tmp_path / "lora.json"
    ns = build_parser().parse_args([
        "bench", "lora", "--model", str(tmp_path / "m"), "--kv-cache-memory", "16MiB",
        "--num-prompts", "6", "--concurrency", "3", "--num-adapters", "1,3", "--max-loras", "1",
        "--no-eager-run", "--output-json", str(out),
    ])  # fmt: skip
    assert lora.main(ns, engine_args_from(ns)) == 0
    results = json.loads(out.read_text())
    assert set(results) == {"base", "1 adapters", "3 adapters"}
    assert all(r["num_useful_output_tokens"] == results["base"]["num_useful_output_tokens"]
               for r in results.values())  # fmt: skip
    # One slot for three adapters: their requests cannot share steps.
    assert results["3 adapters"]["num_steps"] > results["1 adapters"]["num_steps"]
    table = capsys.readouterr().out
    assert "x base" in table and "3 adapters" in table


def test_random_adapters_fit_the_model(tmp_path):
    from pagedllm.config import ModelArchConfig
    from pagedllm.model_loader.lora_adapter import load_lora_adapter

    arch = ModelArchConfig("LlamaForCausalLM", 128, 64, 128, 2, 4, 2, 16)
    lora.write_random_adapter(str(tmp_path / "a"), arch, 8, seed=0)
    adapter = load_lora_adapter(str(tmp_path / "a"), arch, 8)
    assert adapter.rank == 8 and len(adapter.modules) == 2 * 7
