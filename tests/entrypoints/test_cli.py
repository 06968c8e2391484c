"""The `pagedllm` command: generate and chat on the real default model, and flag errors."""

import os
import subprocess
import sys

import pytest

from pagedllm import LLM, SamplingParams

PAGEDLLM = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
ENV = {**os.environ, "PAGEDLLM_LOGGING_LEVEL": "INFO"}
FLAGS = ["--kv-cache-memory", "256MiB", "--max-model-len", "1024"]


def run(args, stdin=None, timeout=300):
    return subprocess.run(PAGEDLLM + args, input=stdin, capture_output=True, text=True,
                          env=ENV, timeout=timeout)  # fmt: skip


@pytest.mark.slow
def test_generate_streams_the_same_text_as_the_offline_api():
    prompt = "The capital of France is"
    result = run(["generate", "--raw", "--max-tokens", "16", *FLAGS, prompt])
    assert result.returncode == 0, result.stderr
    llm = LLM(kv_cache_memory="256MiB", max_model_len=1024)  # the same defaults as the CLI's
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert result.stdout == want[0].outputs[0].text + "\n"
    # The start-up log reports the KV cache in blocks and tokens and the maximum concurrency.
    assert "KV cache:" in result.stderr and "maximum concurrency" in result.stderr
    assert "tokens/s" in result.stderr


@pytest.mark.slow
def test_chat_answers_each_line_with_history():
    result = run(["chat", "--max-tokens", "12", *FLAGS], stdin="Hi!\nWhat did I just say?\n")
    assert result.returncode == 0, result.stderr
    replies = [line for line in result.stdout.split("> ") if line.strip()]
    assert len(replies) == 2 and all(r.strip() for r in replies)


def test_bad_flag_value_is_a_clear_error_not_a_traceback():
    result = run(["generate", "--block-size", "0", "hello"])
    assert result.returncode == 2
    assert "block_size" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_missing_model_or_a_bad_flag_is_one_line_and_nothing_left_running(command):
    # serve starts its engine process before it reads the flags' consequences: that process
    # must not outlive the refusal (it would die with its parent; it must not be left to).
    prompt = ["hi"] if command == "generate" else ["--port", "0"]
    before = _spawned()
    cases = [(["--model", "/nonexistent/model.gguf"], "neither a local path"),
             (["--max-model-len", "999999"], "exceeds the model's context")]  # fmt: skip
    if command == "serve":  # refused by the server alone, after its engine process started
        cases.append((["--limit-concurrency", "0"], "--limit-concurrency must be >= 1"))
    for args, said in cases:
        result = run([command, *args, *prompt])
        assert result.returncode == 2, result.stderr
        assert said in result.stderr and "Traceback" not in result.stderr, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, result.stderr
    assert _spawned() <= before  # no engine process of theirs is left


def _spawned() -> set[int]:
    """The processes multiprocessing spawned (engine processes among them) now alive."""
    found = subprocess.run(["pgrep", "-f", "multiprocessing.spawn"], capture_output=True, text=True)
    return {int(pid) for pid in found.stdout.split()}


@pytest.mark.slow
def test_generate_with_a_json_schema_file_and_a_bad_grammar(tmp_path):
    import json

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    question = "Which city is the capital of France? Answer in JSON."
    result = run(["generate", "--json-schema", f"@{path}", *FLAGS, question])
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)) == {"city"}
    result = run(["generate", "--grammar", "start: nothing", *FLAGS, "hi"])
    assert result.returncode == 2 and "invalid grammar" in result.stderr
    assert "Traceback" not in result.stderr
    result = run(["generate", "--json-schema", "@/nonexistent.json", *FLAGS, "hi"])
    assert result.returncode == 2 and "cannot read" in result.stderr


def test_constraint_flags_become_structured_outputs(tmp_path):
    from pagedllm.entrypoints.cli import build_parser, sampling_params_from

    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "yes" | "no"')

    def constraint(*flags):
        ns = build_parser().parse_args(["generate", *flags, "hi"])
        return sampling_params_from(ns).structured_outputs

    assert constraint() is None
    assert constraint("-j", '{"type": "integer"}').json == {"type": "integer"}
    assert constraint("--regex", "[0-9]+").regex == "[0-9]+"
    assert constraint("--grammar", f"@{grammar}").grammar == 'start: "yes" | "no"'
    with pytest.raises(SystemExit):  # one constraint at most (argparse: exit status 2)
        constraint("--regex", "a", "--grammar", "start: a")


def test_every_engine_flag_round_trips():
    """The engine group (built from EngineArgs' field metadata) reads back what to_cli_args
    writes, for every field with a flag, in each kind of command."""
    import dataclasses

    from pagedllm.config import EngineArgs
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    args = EngineArgs(
        model="m.gguf", tokenizer="tok", dtype="float16", device="cuda", seed=3,
        max_model_len=512, block_size=8, kv_cache_dtype="fp8", kv_cache_memory="1GiB",
        gpu_memory_utilization=0.5,
        num_gpu_blocks_override=64, max_num_seqs=4, max_num_batched_tokens=1024,
        enable_chunked_prefill=False, enable_prefix_caching=False, preemption_mode="swap",
        swap_space=1.5, attention_backend="sdpa", quantization="int4",
        allow_pickle_checkpoints=True, enforce_eager=True, tensor_parallel_size=2,
        kv_allocation="pow2", deterministic=False,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
        kv_events_config='{"enable_kv_cache_events": true}',
        enable_lora=True, max_loras=3, max_lora_rank=64, max_cpu_loras=8,
        scheduling_policy="priority", runner="pooling", pooling_type="MEAN",
        nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500,
        distributed_timeout=60.0, distributed_executor_backend="ray", ray_address="auto",
        data_parallel_size=2, data_parallel_rank=1, data_parallel_size_local=2,
    )  # fmt: skip
    defaults = EngineArgs()
    changed = {
        name for name in EngineArgs.field_names() if getattr(args, name) != getattr(defaults, name)
    }
    assert changed == EngineArgs.field_names() - {"disable_log_stats"}  # it has no engine flag
    parser = build_parser()
    for command in (["generate"], ["chat"], ["serve"], ["bench", "throughput"]):
        rebuilt = engine_args_from(parser.parse_args([*command, *args.to_cli_args()]))
        # --disable-log-stats is serve's own flag, off by default there
        assert rebuilt.disable_log_stats is (command != ["serve"])
        assert dataclasses.replace(rebuilt, disable_log_stats=True) == args, command
    short = engine_args_from(parser.parse_args(["generate", "-q", "int8", "-tp", "2"]))
    assert (short.quantization, short.tensor_parallel_size) == ("int8", 2)
