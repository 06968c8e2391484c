"""`benchmarks.step` and the MFU arithmetic (roofline.py): FLOPs per token against a loaded
model's parameters, the GEMM peak, and the whole command on a tiny random model (structure and
arithmetic only, never timings)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks import common, step, step_timer
from pagedllm.bench import roofline
from pagedllm.config import EngineArgs


def _parse(argv):
    parser = argparse.ArgumentParser()
    step.add_cli_args(parser)
    return parser.parse_args(argv)


def test_cli_defaults_and_registration():
    ns = _parse([])
    assert (ns.num_running, ns.prompt_len, ns.num_steps, ns.prefill_len, ns.schedule_running,
            ns.profile, ns.output_json) == (64, 128, 20, 512, 256, False, None)  # fmt: skip
    ns = common.build_parser(step.add_cli_args).parse_args(["--num-running", "8", "--seed", "3"])
    assert ns.num_running == 8 and ns.seed == 3


def _tiny_config(**overrides):
    from pagedllm.config import ModelArchConfig

    kwargs = dict(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)  # fmt: skip
    kwargs.update(overrides)
    return ModelArchConfig(**kwargs)


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_matches_the_models_matmul_parameters(tied):
    from pagedllm.models.registry import get_model_class

    config = _tiny_config(tie_word_embeddings=tied)
    model = get_model_class(config.architecture)(config)
    # Every distinct parameter once: a tied LM head shares the embedding's tensor.
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    # Matmul weights = everything but the lookup table and the norms; a tied LM head is the
    # embedding tensor itself, yet its matmul still costs hidden x vocab per token.
    matmul = total - embedding - norms + (embedding if tied else 0)
    assert roofline.matmul_params_per_token(config) == matmul
    attention = 4 * config.num_attention_heads * config.head_dim * config.num_hidden_layers
    assert roofline.flops_per_token(config, 0) == 2 * matmul
    assert roofline.flops_per_token(config, 10.5) == pytest.approx(2 * matmul + attention * 10.5)


def test_flops_per_token_caps_the_context_of_sliding_layers():
    config = _tiny_config(sliding_window=8, layer_types=["sliding_attention", "full_attention",
                                                         "sliding_attention"])  # fmt: skip
    per_layer = 4 * config.num_attention_heads * config.head_dim
    base = roofline.flops_per_token(config, 0)
    assert roofline.flops_per_token(config, 100) == pytest.approx(base + per_layer * (8 + 100 + 8))


def test_mfu_and_gemm_peak():
    assert roofline.mfu(10.0, 1e9, 1e11) == pytest.approx(0.1)
    assert roofline.mfu(10.0, 1e9, 0.0) == 0.0
    peak = roofline.measure_gemm_peak(
        torch.float32, shapes=((64, 64, 64), (128, 128, 128)), seconds=0.05
    )
    assert peak["dtype"] == "float32" and peak["best_gflops"] > 0
    assert "gflops" in peak["shapes"][0]  # the first shape always runs
    assert "GFLOP/s" in roofline.gemm_peak_line(peak)
    read = roofline.measure_read_bandwidth(1 << 20, seconds=0.02)
    assert read["bytes"] == 1 << 20 and read["repeats"] >= 3 and read["gb_per_s"] > 0


def test_breakdown_shares_and_outside_forward():
    record = dict(step_s=0.010, schedule=0.001, prepare_inputs=0.001, forward=0.006,
                  logits_and_sampling=0.0015, compute_logits=0.001, sample=0.0005,
                  update_and_outputs=0.0004, other_in_execute_model=0.0001)  # fmt: skip
    b = step_timer.breakdown([record, record])
    assert b["step_ms"] == pytest.approx(10.0)
    assert sum(b["parts"][k]["share"] for k in step_timer.PARTS) == pytest.approx(1.0)
    assert b["outside_forward_share"] == pytest.approx(0.3)  # forward + logits = 70%
    assert "of which compute_logits" in step_timer.breakdown_table(b)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.conftest import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-step-bench")
    save_tiny_llama(path)
    return str(path)


def test_whole_benchmark_on_a_tiny_model(tiny_model, tmp_path, capsys):
    out_json = tmp_path / "step.json"
    ns = _parse(["--num-running", "4", "--prompt-len", "6", "--num-steps", "3",
                 "--prefill-len", "20", "--schedule-running", "12", "--profile",
                 "--output-json", str(out_json)])  # fmt: skip
    # max_num_seqs below --schedule-running: the bench raises it.
    engine_args = EngineArgs(dtype="float32", model=tiny_model, kv_cache_memory="8MiB",
                             block_size=4, max_num_seqs=8)  # fmt: skip
    assert step.main(ns, engine_args) == 0
    printed = capsys.readouterr().out
    for line in ("outside the forward pass: ", "prefill: ", "schedule() at 12 running: ",
                 "decode model FLOPs utilisation", "prefill model FLOPs utilisation",
                 "GEMM peak, float32", "Self CPU"):  # fmt: skip
        assert line in printed
    r = json.loads(out_json.read_text())
    decode = r["decode"]
    assert decode["num_steps"] == 3 and len(decode["steps"]) == 3
    for record in decode["steps"]:
        # Pure decode steps of all 4 requests, and the parts sum to the step.
        assert (record["num_seqs"], record["num_tokens"], record["num_prefill_seqs"]) == (4, 4, 0)
        parts = sum(record[k] for k in step_timer.PARTS)
        assert parts == pytest.approx(record["step_s"], rel=1e-6, abs=1e-9)
        assert all(record[k] >= 0 for k in ("schedule", "prepare_inputs", "forward", "sample"))
    for phase in (decode, r["prefill"]):
        shares = [phase["parts"][k]["share"] for k in step_timer.PARTS]
        assert all(0 <= s <= 1 for s in shares) and sum(shares) == pytest.approx(1)
        assert 0 <= phase["outside_forward_share"] <= 1
        assert 0 < phase["mfu"] <= 1
    # Contexts: decode tokens attend to the prompt and what came after it; a prefill's mean.
    assert 6 < decode["mean_context_len"] < 6 + 3 + 8
    assert r["prefill"]["mean_context_len"] == pytest.approx(10.5)
    assert r["prefill"]["steps_per_run"] == 1 and r["prefill"]["prompt_tokens_per_s"] > 0
    assert r["schedule"]["num_running"] == 12 and len(r["schedule"]["schedule_ms"]) == 3
    assert r["schedule"]["num_seqs_per_step"] == [12, 12, 12]
    assert r["engine_args"]["max_num_seqs"] == 12
    assert set(r["targets"]) == {"outside_forward_share", "prefill_tokens_per_s", "schedule_ms",
                                 "decode_mfu", "prefill_mfu"}  # fmt: skip
    assert r["gemm_peak"]["best_gflops"] > 0
    # The roofline of a decode step: the float weights (every linear layer's, the tied head's
    # too) and the K/V of 4 requests' contexts, against reading that many bytes once.
    from pagedllm.model_loader.loader import load_model_config
    from pagedllm.models.registry import get_model_class

    config, _ = load_model_config(tiny_model)
    model = get_model_class(config.architecture)(config)
    linears = [m for m in model.modules() if hasattr(m, "quant_method")]
    streaming = r["weight_streaming"]
    assert streaming["weight_bytes"] == sum(m.weight.nbytes for m in linears)
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert streaming["kv_bytes"] == int(4 * decode["mean_context_len"] * kv_per_token)
    assert streaming["read"]["bytes"] >= streaming["weight_bytes"] + streaming["kv_bytes"]
    assert streaming["ratio"] == pytest.approx(decode["step_ms"] / streaming["streaming_ms"])
    assert "weight streaming: " in printed
    # Every projection alone at the step's 4 rows, by kind; the step against that.
    gemms = r["gemms_alone"]
    assert (gemms["rows"], gemms["num_projections"]) == (4, len(linears))
    assert set(gemms["by_kind_ms"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                                        "lm_head"}  # fmt: skip
    assert gemms["passes"] >= 3 and gemms["gemm_ms"] > 0
    assert gemms["ratio"] == pytest.approx(decode["step_ms"] / gemms["gemm_ms"])
    assert f"GEMMs alone: {len(linears)} projections at 4 rows alone" in printed


def test_rejects_bad_sizes(tiny_model):
    engine_args = EngineArgs(
        dtype="float32", model=tiny_model, kv_cache_memory="8MiB", block_size=4
    )
    with pytest.raises(ValueError, match="--num-running"):
        step.main(_parse(["--num-running", "0"]), engine_args)
    with pytest.raises(ValueError, match="max_model_len"):  # the tiny model has 256 positions
        step.main(_parse(["--prefill-len", "300"]), engine_args)
