"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss): a softmax router picks each token's
top-k experts, and the token's output is their outputs weighted by the router's probabilities.

The experts run grouped by expert, not by token: the step's (token, expert) pairs are sorted
by expert, and each expert that any token chose multiplies all of its tokens' rows in one
product. Each expert is an ordinary gate/up + down MLP of linear layers, so its weights take
every format a dense layer takes (float, prepacked, a GGUF's codes in integers) and split
across a tensor-parallel group the same way: by the experts' intermediate size, the partial
sums of all experts added by one all-reduce at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import ModelArchConfig
from pagedllm.distributed import all_reduce
from pagedllm.layers.activation import ClampedSwiGLU, SiluAndMul
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import QuantizationConfig


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x), up(x))), silu(gate) * up or gpt-oss's clamped SwiGLU, its
    down projection's partial sum left to the block (reduced once for all experts)."""

    def __init__(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
        intermediate: int | None = None,
    ):
        """`intermediate`: the size of this one (a shared expert's), else the experts'."""
        super().__init__()
        hidden, bias = config.hidden_size, config.expert_bias
        inter = intermediate or config.moe_intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], bias, dtype, quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            inter, hidden, bias, dtype, quant_config, f"{prefix}.down_proj", reduce_results=False
        )
        if config.swiglu_limit is None:
            self.act_fn = SiluAndMul()
        else:
            self.act_fn = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Router(nn.Module):
    """The router's [num_experts, hidden] weight (and bias), held whole by every rank (small)."""

    def __init__(self, num_experts: int, hidden: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), False)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype), False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class SparseMoeBlock(nn.Module):
    """Checkpoint names as Qwen3-MoE's: `gate` (the router), `experts.{e}.{gate,up,down}_proj`,
    `shared_expert.{gate,up,down}_proj`."""

    def __init__(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.softmax_after_topk = config.router_softmax_after_topk
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"{self.top_k} experts per token of {self.num_experts}: must be 1..num_experts"
            )
        self.gate = Router(self.num_experts, config.hidden_size, config.router_bias, dtype)
        self.experts = nn.ModuleList(
            ExpertMLP(config, dtype, quant_config, f"{prefix}.experts.{e}")
            for e in range(self.num_experts)
        )
        self.shared_expert = None
        if config.shared_expert_intermediate_size:  # every token's, beside its chosen ones
            self.shared_expert = ExpertMLP(
                config, dtype, quant_config, f"{prefix}.shared_expert",
                config.shared_expert_intermediate_size,
            )  # fmt: skip
        # Qwen3-Next's: the shared expert scaled by sigmoid of its own one-row router.
        self.shared_expert_gate = (
            Router(1, config.hidden_size, False, dtype) if config.shared_expert_gate else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]): the softmax (in float32) of the router's
        logits, its top k, renormalised if the architecture does; or (gpt-oss) the softmax of
        the top k logits."""
        logits = self.gate(x).float()
        if self.softmax_after_topk:
            top, ids = logits.topk(self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), ids
        weights, ids = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if x.shape[0] == 1:  # one token (one stream's decode): no grouping to do
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for e, w in sorted(zip(ids[0].tolist(), weights[0], strict=True)):
                out += self.experts[e](x).float() * w  # index order, as the grouped path adds
            return self._finish(out, x)
        # Sorted by expert (stable: each expert's tokens in step order), so that each expert's
        # rows are one slice; `tokens[i]` is the row of the i-th sorted (token, expert) pair.
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order].unsqueeze(1)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        # Summed in float32, expert after expert in index order (as transformers adds them).
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                rows = tokens[start : start + n]
                y = expert(x[rows])
                out.index_add_(0, rows, y.float() * pair_weights[start : start + n])
                start += n
        return self._finish(out, x)

    def _finish(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output added, the ranks' partial sums reduced, in x's dtype."""
        if self.shared_expert is not None:
            shared = self.shared_expert(x).float()
            if self.shared_expert_gate is not None:
                shared *= torch.sigmoid(self.shared_expert_gate(x).float())
            out += shared
        return all_reduce(out.to(x.dtype))
