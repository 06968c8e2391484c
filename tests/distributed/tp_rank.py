"""One rank of the tensor-parallel model tests (tests/distributed/test_tp_model.py): launched once
per rank with torch.distributed's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as
torchrun sets it). Builds each checkpoint's model as the engine does (model_loader.build, this
rank's shard, QUANTIZATION's weights), decodes the prompts greedily through a paged cache;
rank 0 saves the logits of every step, every rank its parameter count, into
OUT_DIR/<output_name(spec)>/. One launch runs several checkpoints: the processes start once.

    python tests/distributed/tp_rank.py OUT_DIR DTYPE QUANTIZATION:CHECKPOINT...
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from pagedllm.config import LoadConfig, ModelConfig  # noqa: E402
from pagedllm.distributed import set_tp_group  # noqa: E402
from pagedllm.model_loader.build import build_model  # noqa: E402
from pagedllm.model_loader.loader import load_model_config  # noqa: E402
from tests.models.paged_runner import PagedRunner  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [11, 3], [120, 42, 8, 8, 1, 64, 23, 9, 90, 4]]


def build(checkpoint: str, dtype: str, quantization: str) -> torch.nn.Module:
    """The model as build_model makes it for this rank, its modules run (no fused decoder)."""
    arch, name = load_model_config(checkpoint)
    config = ModelConfig(
        model=checkpoint, tokenizer=None, name=name, arch=arch, dtype=dtype, max_model_len=256,
        seed=0, quantization=quantization, enforce_eager=True,
    )  # fmt: skip
    return build_model(config, LoadConfig(), torch.device("cpu"), "cpu").model


def decode(model) -> list[torch.Tensor] | None:
    """Every step's logits of each prompt (on rank 0; None elsewhere)."""
    reqs = TPPagedRunner(model, block_size=4, num_blocks=64).generate(PROMPTS, 8, [4, 2, 3])
    return [torch.stack(r.logits) for r in reqs] if reqs[0].logits else None


def output_name(spec: str) -> str:
    """ "int4:/tmp/x/ckpt" -> "ckpt-int4"."""
    quantization, _, checkpoint = spec.partition(":")
    return f"{os.path.basename(checkpoint.rstrip('/'))}-{quantization}"


class TPPagedRunner(PagedRunner):
    def greedy(self, logits, rows):
        """Rank 0 has the gathered logits: its argmax goes to every rank."""
        if not dist.is_initialized():
            return super().greedy(logits, rows)
        tokens = logits.argmax(-1) if logits is not None else torch.empty(rows, dtype=torch.long)
        dist.broadcast(tokens, src=0)
        return tokens.tolist()


def main(out_dir: str, dtype: str, *specs: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env://
    rank, size = dist.get_rank(), dist.get_world_size()
    set_tp_group(rank, size)
    for spec in specs:
        out = os.path.join(out_dir, output_name(spec))
        os.makedirs(out, exist_ok=True)
        quantization, _, checkpoint = spec.partition(":")
        model = build(checkpoint, dtype, quantization)
        logits = decode(model)
        params = sum(p.numel() for p in model.parameters())
        embedding = model.model.embed_tokens.weight.numel()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"params": params, "embedding": embedding}, f)
        if rank == 0:
            torch.save(logits, os.path.join(out, "logits.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
