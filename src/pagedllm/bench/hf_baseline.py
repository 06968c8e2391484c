"""`--baseline hf` of `pagedllm bench throughput`: the same requests through transformers'
`generate` on the same weights, in static, left-padded batches of `--hf-batch-size` in arrival
order, each batch generating the longest output in it (what a padded HF batch implies for both
time and KV cache)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pagedllm.bench.utils import cpu_counters, others_cpu_share, speed_figures
from pagedllm.bench.workload import KVSlotUsage, WorkloadRequest, static_batch_kv_usage


def resolve_hf_source(model: str | None) -> tuple[Path, str | None]:
    """(directory, GGUF file name or None) for transformers' `from_pretrained`, from the same
    `--model` pagedllm loaded: a Hugging Face directory as it is, anything else via its GGUF."""
    from pagedllm.model_loader import resolve_model

    path = Path(resolve_model(model))
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    raise ValueError(
        f"the HF baseline cannot load {model!r} ({path}): pass a .gguf file or a Hugging Face "
        "directory as --model"
    )


def load_hf_model(directory: Path, gguf_file: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs)
    return model.eval()


def _left_pad(prompts: list[list[int]], pad_id: int):
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def eos_ids(model) -> list[int]:
    for source in (model.generation_config, model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            return [eos]
        if eos:
            return [int(e) for e in eos]
    return [0]


def run_hf(model, requests: list[WorkloadRequest], batch_size: int) -> dict[str, Any]:
    """Static, left-padded batches in arrival order; each runs to its longest output."""
    import torch

    eos = eos_ids(model)
    pad_id = eos[0]

    def generate(prompts: list[list[int]], num_new: int):
        input_ids, attention_mask = _left_pad(prompts, pad_id)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                do_sample=False,
                pad_token_id=pad_id,
                eos_token_id=eos,
            )
        return out[:, input_ids.shape[1] :]

    generate([requests[0][0][:8]], 2)  # warm-up

    token_ids: list[list[int]] = []
    generated = 0
    cpu_before = cpu_counters()
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        num_new = max(n for _, n in batch)
        new_tokens = generate([p for p, _ in batch], num_new)
        generated += new_tokens.numel()
        for row, (_, n) in enumerate(batch):
            token_ids.append(new_tokens[row, :n].tolist())
    elapsed = time.perf_counter() - start
    others = others_cpu_share(cpu_before, cpu_counters())

    kv = static_batch_kv_usage([(len(p), n) for p, n in requests], batch_size)
    return {
        **speed_figures(requests, token_ids, generated, elapsed),
        "batch_size": batch_size,
        "num_batches": -(-len(requests) // batch_size),
        "others_cpu_share": others,
        "kv_cache": _static_kv_dict(kv),
        "eos_token_ids": eos,
        "token_ids": token_ids,
    }


def _static_kv_dict(kv: KVSlotUsage) -> dict[str, Any]:
    return {
        "reserved_slots": kv.reserved_slots,
        "used_slots": kv.used_slots,
        "used_share": kv.used_share,
        "waste_share": kv.waste_share,
    }
