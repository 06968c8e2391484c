"""One rank of a tensor-parallel model test (tests/distributed/test_tp_model.py): launched once
per rank with torch.distributed's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as
torchrun sets it). Loads the tiny checkpoint sharded, decodes the prompts greedily through a
paged cache; rank 0 saves the logits of every step, every rank its parameter count.

    python tests/distributed/tp_rank.py CHECKPOINT_DIR OUT_DIR DTYPE
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from pagedllm.distributed import set_tp_group  # noqa: E402
from pagedllm.model_loader import load_hf_dir  # noqa: E402
from pagedllm.models import get_model_class  # noqa: E402
from tests.models.paged_runner import PagedRunner  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [11, 3], [120, 42, 8, 8, 1, 64, 23, 9, 90, 4]]


class TPPagedRunner(PagedRunner):
    def greedy(self, logits, rows):
        """Rank 0 has the gathered logits: its argmax goes to every rank."""
        tokens = logits.argmax(-1) if logits is not None else torch.empty(rows, dtype=torch.long)
        dist.broadcast(tokens, src=0)
        return tokens.tolist()


def main(checkpoint: str, out_dir: str, dtype: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env://
    rank, size = dist.get_rank(), dist.get_world_size()
    set_tp_group(rank, size)
    loaded = load_hf_dir(checkpoint, lazy=True)  # one tensor at a time, as the engine loads
    model = get_model_class(loaded.config.architecture)(loaded.config, "cpu")
    model.load_weights(loaded.weights)
    model = model.to(getattr(torch, dtype)).eval()
    runner = TPPagedRunner(model, block_size=4, num_blocks=64)
    reqs = runner.generate(PROMPTS, 8, chunk_sizes=[4, 2, 3])
    params = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"params": params, "embedding": embedding}, f)
    if rank == 0:
        torch.save([torch.stack(r.logits) for r in reqs], os.path.join(out_dir, "logits.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
