"""`pagedllm generate | chat | serve | kv-calc | bench`: the command line."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
import typing

from pagedllm.config import EngineArgs, parse_bytes
from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

# The command line's start (its torch-free imports done), for serve's start-up line.
STARTED = time.perf_counter()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine group: a flag for each EngineArgs field with a help text (config/engine_args.py).
    Its choices are left to EngineArgs.validate(), which LLM(...) runs as well."""
    defaults = EngineArgs()
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineArgs):
        meta = field.metadata
        if "help" not in meta:
            continue
        names = ["--" + field.name.replace("_", "-"), *([meta["short"]] if "short" in meta else [])]
        default = getattr(defaults, field.name)
        if "action" in meta:
            group.add_argument(*names, action=meta["action"], default=default, help=meta["help"])
            continue
        # The annotation's first type (`int | None` -> int) reads the text.
        type_ = (typing.get_args(hints[field.name]) or (hints[field.name],))[0]
        shown = "" if default is None else f" (default: {default})"
        group.add_argument(*names, type=type_, default=default, help=meta["help"] + shown)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The EngineArgs fields in `ns`: the engine group's flags, and serve's --disable-log-stats."""
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in EngineArgs.field_names()})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    constraint = group.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema",
        "-j",
        metavar="SCHEMA",
        help="constrain the output to this JSON schema (JSON text, or @FILE)",
    )
    constraint.add_argument("--regex", help="constrain the output to this regular expression")
    constraint.add_argument("--grammar", metavar="GRAMMAR",
                            help="constrain the output to this grammar, Lark or llama.cpp's GBNF "
                                 "(the text, or @FILE)")  # fmt: skip


def sampling_params_from(ns: argparse.Namespace):
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

    constraint = None
    if ns.json_schema is not None:
        constraint = StructuredOutputsParams(json=_text_or_file(ns.json_schema))
    elif ns.regex is not None:
        constraint = StructuredOutputsParams(regex=ns.regex)
    elif ns.grammar is not None:
        constraint = StructuredOutputsParams(grammar=_text_or_file(ns.grammar))
    return SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
        min_p=ns.min_p, repetition_penalty=ns.repetition_penalty, stop=ns.stop,
        ignore_eos=ns.ignore_eos, structured_outputs=constraint,
    )  # fmt: skip


def _text_or_file(value: str) -> str:
    """`@path`: the file's text (as curl reads request bodies); anything else as it is."""
    if not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {value[1:]}: {e.strerror}") from None


def _stream(engine, prompt, params, lora=None) -> tuple[str, int, float]:
    """Run one request, printing text as it arrives; returns (text, tokens, seconds)."""
    start = time.perf_counter()
    request_id = engine.add_request(None, prompt, params, delta=True, lora_request=lora)
    text, num_tokens = [], 0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                delta = output.outputs[0].text
                num_tokens += len(output.outputs[0].token_ids)
                text.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    sys.stdout.write("\n")
    return "".join(text), num_tokens, time.perf_counter() - start


def cmd_generate(ns: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import LLMEngine

    params = sampling_params_from(ns)  # bad sampling flags fail before the model loads
    args = engine_args_from(ns)
    lora = None
    if ns.lora is not None:
        from pagedllm.lora_request import LoRARequest

        args.enable_lora = True
        lora = LoRARequest("lora", 1, ns.lora)
    engine = LLMEngine(args)
    prompt = ns.prompt if ns.prompt is not None else sys.stdin.read()
    if ns.chat_template_off:
        full_prompt = prompt
    else:
        messages = [{"role": "user", "content": prompt}]
        if ns.system:
            messages.insert(0, {"role": "system", "content": ns.system})
        full_prompt = _chat_prompt(engine, messages)
    _, num_tokens, seconds = _stream(engine, full_prompt, params, lora)
    print(f"[{num_tokens} tokens in {seconds:.2f} s, {num_tokens / seconds:.1f} tokens/s]",
          file=sys.stderr)  # fmt: skip
    return 0


def _chat_prompt(engine, messages) -> dict:
    tokenizer = engine.tokenizer
    if tokenizer is None or tokenizer.chat_template is None:
        raise SystemExit("this model has no chat template: use --raw")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def cmd_chat(ns: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import LLMEngine

    params = sampling_params_from(ns)  # bad sampling flags fail before the model loads
    engine = LLMEngine(engine_args_from(ns))
    messages = [{"role": "system", "content": ns.system}] if ns.system else []
    print("Type a message and press Enter; an empty line, 'exit' or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip() or line.strip() in ("exit", "quit"):
            break
        messages.append({"role": "user", "content": line})
        reply, _, _ = _stream(engine, _chat_prompt(engine, messages), params)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    if ns.model_tag is not None:
        ns.model = ns.model_tag
    args = engine_args_from(ns)
    replicas = args.data_parallel_size > 1 and args.data_parallel_rank is None
    if replicas and not ns.engine_process:
        raise ValueError("--data-parallel-size > 1 runs each replica in an engine process")
    launched = None
    if ns.engine_process and not replicas:
        # The engine process first (torch-free to start): it imports and loads its model on
        # another core while this process imports the server below.
        from pagedllm.engine.core_launch import EngineLaunch

        launched = EngineLaunch.early(args)
    try:
        return _serve(ns, args, replicas, launched)
    finally:
        if launched is not None and not launched.adopted:
            launched.kill()


def _serve(ns: argparse.Namespace, args: EngineArgs, replicas: bool, launched) -> int:
    # With the engine in its own process this process never imports torch: it tokenizes,
    # detokenizes and serves HTTP; the engine process runs the model.
    from pagedllm.engine.core_client import EngineCoreClient
    from pagedllm.engine.dp_client import DataParallelClient
    from pagedllm.entrypoints.openai.api_server import run_server
    from pagedllm.entrypoints.openai.server_config import server_config_from

    imported = time.perf_counter()
    config = server_config_from(ns)
    if ns.engine_process:  # the engine in its own process, restarted when it fails
        client = DataParallelClient if replicas else EngineCoreClient
        extra = {} if replicas else {"launched": launched}
        try:
            async_engine = client(
                args,
                step_timeout=ns.engine_step_timeout,
                max_restarts=ns.max_engine_restarts,
                max_stream_backlog=ns.max_stream_backlog,
                **extra,
            )
        except RuntimeError as e:
            raise SystemExit(f"pagedllm serve: {e}") from None
    else:  # run_server runs the engine loop on this thread
        from pagedllm.engine.async_llm_engine import AsyncLLMEngine
        from pagedllm.engine.llm_engine import LLMEngine

        async_engine = AsyncLLMEngine(
            LLMEngine(args), start_thread=False, max_stream_backlog=ns.max_stream_backlog
        )
    engine = "engine" if launched is None else "engine (started before the imports)"
    phases = {"imports": imported - STARTED, engine: time.perf_counter() - imported}
    try:
        run_server(async_engine, config, started=(STARTED, phases))
    finally:  # also when the app cannot be built (a bad --lora-modules adapter)
        async_engine.shutdown()
    return 0


def cmd_kv_calc(ns: argparse.Namespace) -> int:
    from pagedllm.config import ModelArchConfig
    from pagedllm.kv_calc import format_report, kv_memory_report

    manual = (ns.num_layers, ns.num_kv_heads, ns.head_dim)
    if any(v is not None for v in manual):
        if None in manual or ns.model is not None:
            raise ValueError("give a MODEL, or all of --num-layers, --num-kv-heads, --head-dim")
        sliding = ns.num_sliding_layers if ns.sliding_window else 0
        if sliding is None:
            sliding = ns.num_layers
        if not 0 <= sliding <= ns.num_layers:
            raise ValueError(f"--num-sliding-layers must be in [0, {ns.num_layers}]")
        config = ModelArchConfig(
            "custom", vocab_size=0, hidden_size=0, intermediate_size=0,
            num_hidden_layers=ns.num_layers, num_attention_heads=ns.num_kv_heads,
            num_key_value_heads=ns.num_kv_heads, head_dim=ns.head_dim,
            max_position_embeddings=ns.max_model_len or 2048,
            sliding_window=ns.sliding_window or None,
            layer_types=["sliding_attention"] * sliding
            + ["full_attention"] * (ns.num_layers - sliding),
        )  # fmt: skip
        name = "custom"
    else:
        from pagedllm.model_loader.loader import load_model_config

        config, name = load_model_config(ns.model)
    report = kv_memory_report(
        config, ns.max_model_len, ns.kv_cache_memory, ns.dtype, ns.block_size, name
    )
    print(format_report(report))
    return 0


# `pagedllm bench <name>` before the experiments moved to benchmarks/ (python -m benchmarks.<name>).
MOVED_BENCHMARKS = (
    "prefix-caching", "sharing", "preemption", "sliding-window", "quantization", "soak", "load",
    "block-size", "peers", "step", "structured", "dashboard", "attention", "kv-waste",
)  # fmt: skip


def _moved_command(name: str, args: list[str] = ()) -> str:
    return shlex.join(["python", "-m", "benchmarks." + name.replace("-", "_"), *args])


def _moved(name: str, args: list[str]) -> int:
    print(f"pagedllm bench {name} has moved out of the package: run `{_moved_command(name, args)}`"
          " from the root of a pagedllm checkout", file=sys.stderr)  # fmt: skip
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply to one prompt, streamed")
    gen.add_argument("prompt", nargs="?", help="the prompt (default: read standard input)")
    gen.add_argument("--raw", dest="chat_template_off", action="store_true",
                     help="send the prompt as it is, without the chat template")  # fmt: skip
    gen.add_argument("--system", default=None, help="a system message")
    gen.add_argument(
        "--lora",
        default=None,
        metavar="PATH",
        help="run with this LoRA adapter (a PEFT directory or a GGUF LoRA file)",
    )
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with the model's template")
    chat.add_argument("--system", default=None, help="a system message")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="the model (as --model; default: SmolLM2-135M-Instruct)")  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1", help="address (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model's name in the API (default: MODEL)")  # fmt: skip
    serve.add_argument("--api-key", default=None,
                       help="require this Bearer key on every route but /health (or "
                            "$PAGEDLLM_API_KEY)")  # fmt: skip
    serve.add_argument("--no-dashboard", dest="enable_dashboard", action="store_false",
                       help="do not serve the live KV-cache dashboard (/dashboard and its JSON, "
                            "/debug/kv)")  # fmt: skip
    serve.add_argument("--disable-metrics-auth", action="store_true",
                       help="with --api-key, leave /metrics open too (for a scraper)")  # fmt: skip
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log each request's prompts and sampling parameters (off: prompts "
                            "are never logged)")  # fmt: skip
    limits = serve.add_argument_group("limits on one request (beyond them: 400, or 413)")
    limits.add_argument("--max-request-body-bytes", type=parse_bytes, default=8 << 20,
                        help="largest request body, in bytes or with a unit; 0: no limit "
                             "(default: 8MiB)")  # fmt: skip
    limits.add_argument("--max-n", type=int, default=16,
                        help="most sequences one request runs: n, best_of or beam width "
                             "(default: 16)")  # fmt: skip
    limits.add_argument("--max-logprobs", type=int, default=20,
                        help="most logprobs / top_logprobs per token (default: 20)")  # fmt: skip
    limits.add_argument("--max-stop", type=int, default=64,
                        help="most stop strings, and stop token ids, per request "
                             "(default: 64)")  # fmt: skip
    limits.add_argument(
        "--max-prompts",
        type=int,
        default=128,
        help="most prompts in one /v1/completions request (default: 128)",
    )
    conns = serve.add_argument_group("connections (slow or idle clients are cut off)")
    conns.add_argument("--limit-concurrency", type=int, default=None,
                       help="connections + requests at once, past it a 503")  # fmt: skip
    conns.add_argument("--timeout-keep-alive", type=float, default=5.0,
                       help="seconds an idle keep-alive connection lives (default: 5)")  # fmt: skip
    conns.add_argument("--timeout-request-header", type=float, default=10.0,
                       help="seconds a request's headers may take to arrive, whatever trickles "
                            "in; 0: no limit (default: 10)")  # fmt: skip
    conns.add_argument("--timeout-request-body", type=float, default=60.0,
                       help="seconds its body may take after them, or a 408; 0: no limit "
                            "(default: 60)")  # fmt: skip
    conns.add_argument("--send-buffer-bytes", type=int, default=65536,
                       help="each connection's kernel send buffer, so that a client that stops "
                            "reading stops the server's writer soon (then --max-stream-backlog "
                            "applies); 0: the kernel's own, which grows to MiBs (default: "
                            "65536)")  # fmt: skip
    serve.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="chat answers' <think> ... </think> text into reasoning_content",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served as model names (needs --enable-lora)",
    )
    serve.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    serve.add_argument("--chat-template", default=None,
                       help="a chat template file, or the template itself")  # fmt: skip
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide when to call tools (tool_choice "auto"); '
                            "needs --tool-call-parser")  # fmt: skip
    serve.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="how tool calls are read from the model's text: hermes "
                            "(<tool_call>{...}</tool_call>) or json (a JSON call object or "
                            "list)")  # fmt: skip
    serve.add_argument("--max-num-queued-reqs", "--max-waiting-requests", type=int, default=1024,
                       dest="max_waiting_requests",
                       help="refuse requests with 503 while this many wait to be scheduled; "
                            "0: no bound (default: 1024)")  # fmt: skip
    serve.add_argument("--graceful-shutdown-timeout", type=float, default=5.0,
                       help="on Ctrl-C / SIGTERM, seconds running requests get to finish before "
                            "the engine stops (default: 5)")  # fmt: skip
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic throughput / queue / KV-cache log line")  # fmt: skip
    serve.add_argument("--log-stats-interval", type=float, default=10.0,
                       help="seconds between those lines (default: 10)")  # fmt: skip
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine in its own process, restarted when it crashes or "
                            "hangs, its unfinished requests resumed (default); "
                            "--no-engine-process: on this process's main thread, not "
                            "restarted")  # fmt: skip
    serve.add_argument("--engine-step-timeout", type=float, default=120.0,
                       help="seconds without a finished step, while requests are in flight, "
                            "before the engine process counts as hung and is restarted "
                            "(default: 120)")  # fmt: skip
    serve.add_argument("--max-engine-restarts", type=int, default=5,
                       help="engine restarts allowed within 10 minutes; one more and the "
                            "server answers 503 (default: 5)")  # fmt: skip
    serve.add_argument("--max-stream-backlog", type=int, default=512,
                       help="outputs a streamed response may leave unread (a client that does "
                            "not read) before its request is aborted; 0: no bound "
                            "(default: 512)")  # fmt: skip
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    kv = sub.add_parser(
        "kv-calc",
        help="KV-cache bytes per token and per request, and how many requests fit "
        "(reads only the model's config)",
    )
    kv.add_argument("model", nargs="?", default=None,
                    help="GGUF file, HF directory or config.json, or a packaged model's short "
                         "name (default: SmolLM2-135M-Instruct)")  # fmt: skip
    kv.add_argument("--max-model-len", type=int, default=None,
                    help="tokens per request (default: the model's context length)")  # fmt: skip
    kv.add_argument("--kv-cache-memory", default="4GiB", help="memory for the KV cache")
    kv.add_argument("--dtype", "--kv-cache-dtype", default="bfloat16",
                    help="what the KV cache stores: float32 | bfloat16 | float16 | int8 | fp8 | "
                         "fp8_e5m2 (default: bfloat16)")  # fmt: skip
    kv.add_argument("--block-size", type=int, default=16, help="tokens per block")
    manual = kv.add_argument_group("a model by its numbers, instead of MODEL")
    manual.add_argument("--num-layers", type=int)
    manual.add_argument("--num-kv-heads", type=int)
    manual.add_argument("--head-dim", type=int)
    manual.add_argument("--sliding-window", type=int, default=None)
    manual.add_argument("--num-sliding-layers", type=int, default=None,
                        help="layers with the sliding window (default: all)")  # fmt: skip
    kv.set_defaults(func=cmd_kv_calc)

    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve (the experiments "
                           "are the checkout's python -m benchmarks.<name>)")  # fmt: skip
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pagedllm.bench import latency, lora, throughput
    from pagedllm.bench import serve as serve_bench

    # Offline benchmarks: each takes every engine flag plus its own.
    for name, module, help_ in (
        ("throughput", throughput, "offline throughput on a sharegpt-like workload"),
        ("latency", latency, "end-to-end latency of one batch of requests, as vllm bench latency"),
        ("lora", lora, "multi-LoRA throughput over 1, 4, 16 adapters against the base model"),
    ):
        bench_parser = bench_sub.add_parser(name, help=help_)
        add_engine_args(bench_parser)
        module.add_cli_args(bench_parser)
        bench_parser.set_defaults(
            func=lambda ns, module=module: module.main(ns, engine_args_from(ns))
        )
    serve_parser = bench_sub.add_parser(
        "serve", help="online: a Poisson stream of requests against a running pagedllm serve"
    )
    serve_bench.add_cli_args(serve_parser)
    serve_parser.set_defaults(func=serve_bench.main)

    # The experiments moved to the checkout's top-level benchmarks/ tree: their old commands
    # take any arguments (no option is parsed: prefix_chars matches none) and name the new one.
    for name in MOVED_BENCHMARKS:
        moved = bench_sub.add_parser(name, help=f"moved: {_moved_command(name)}",
                                     add_help=False, prefix_chars="\0")  # fmt: skip
        moved.add_argument("args", nargs="*")
        moved.set_defaults(func=lambda ns, name=name: _moved(name, ns.args))
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        if getattr(ns, "tensor_parallel_size", 1) > 1:
            from pagedllm.distributed.process_group import launched_rank
            from pagedllm.engine.arg_utils import create_engine_config
            from pagedllm.executor.multiproc import run_node, run_worker

            rank = launched_rank()
            if rank:  # torchrun started this rank > 0: it serves rank 0's steps, nothing else
                run_worker(create_engine_config(engine_args_from(ns)), rank)
                return 0
            if getattr(ns, "node_rank", 0) > 0:  # a host of --nnodes: its ranks, no engine
                return run_node(create_engine_config(engine_args_from(ns)))
        return ns.func(ns) or 0
    except (ValueError, FileNotFoundError) as e:  # bad flags or input, a missing model file
        print(f"error: {e}", file=sys.stderr)  # a clear message, no traceback
        return 2


if __name__ == "__main__":
    sys.exit(main())
