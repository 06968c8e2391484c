"""Linear layers split across the tensor-parallel group (distributed/parallel.py), as Megatron-LM
splits a transformer: column-parallel layers hold some of the output rows (q/k/v by GQA heads,
gate/up by halves), row-parallel ones some of the input columns, their partial sums added by an
all-reduce inside. With one rank each is a plain linear layer.

Each layer's weight has a `weight_loader` that takes a checkpoint tensor as the file stores it
(the whole layer's, or one part of a packed layer: `shard_id`, its index in the model's
packed_modules_mapping), cuts this rank's slice and writes it where it goes. What the weight is
(float, prepacked, int8 / int4 codes) is the layer's quant_method's business, chosen when the
layer is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.distributed import HeadShard, all_reduce, tp_group
from pagedllm.distributed.parallel import split
from pagedllm.layers.quantization import QuantizationConfig, QuantWeight
from pagedllm.layers.quantization.unquantized import padded_rows
from pagedllm.layers.weight_utils import check_shape, narrow

Loaded = torch.Tensor | QuantWeight


@dataclass(frozen=True)
class Shard:
    """This rank's rows of one part of a layer's output: rows start.. of the part's full_rows."""

    full_rows: int
    start: int
    rows: int


def even_shard(rows: int, what: str) -> Shard:
    return Shard(rows, *split(rows, what))


class LinearBase(nn.Module):
    """y = x W^T (+ b) over this rank's partition of W."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        input_shard: tuple[int, int],
        output_shards: list[Shard],
        bias: bool,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
        tied: bool = False,
    ):
        """input_size, output_size: the whole layer's; input_shard: (first column, columns) of
        this rank's; output_shards: this rank's rows of each part, in order. tied: an LM head
        whose float weight is the embedding's."""
        super().__init__()
        self.input_size, self.output_size, self.tied = input_size, output_size, tied
        self.input_start, self.input_size_per_partition = input_shard
        self.output_shards = output_shards
        self.output_size_per_partition = sum(s.rows for s in output_shards)
        self.quant_method = (quant_config or QuantizationConfig()).get_quant_method(self, prefix)
        self.quant_method.create_weights(self, dtype)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_partition, dtype=dtype), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.lora = None  # LoRA slots (layers/lora.py), attached by the worker with --enable-lora

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None = None):
        raise NotImplementedError

    @property
    def forward_bias(self) -> torch.Tensor | None:
        """The bias this rank adds (RowParallelLinear: rank 0 only)."""
        return self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.forward_bias)
        if self.lora is not None:
            self.lora.apply(y, x)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.input_size_per_partition}, "
            f"out_features={self.output_size_per_partition}, bias={self.bias is not None}, "
            f"{type(self.quant_method).__name__}"
        )


class ColumnParallelLinear(LinearBase):
    """The output rows split across ranks (evenly, unless output_shards says how)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        *,
        output_shards: list[Shard] | None = None,
    ):
        if output_shards is None:
            output_shards = [even_shard(output_size, f"{prefix or 'a layer'}'s output rows")]
        super().__init__(
            input_size, output_size, input_shard=(0, input_size), output_shards=output_shards,
            bias=bias, dtype=dtype, quant_config=quant_config, prefix=prefix,
        )  # fmt: skip

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None = None):
        """loaded: part `shard_id` of the layer, or the whole layer (a packed layer stored
        fused, as Phi-3's checkpoints store qkv_proj and gate_up_proj)."""
        columns = () if param is self.bias else (self.input_size,)
        shards = self.output_shards
        if shard_id is None and len(shards) > 1:
            check_shape(loaded, (sum(s.full_rows for s in shards), *columns))
            start = 0
            for i, s in enumerate(shards):
                self.weight_loader(param, narrow(loaded, 0, start, s.full_rows), i)
                start += s.full_rows
            return
        i = shard_id or 0
        shard = shards[i]
        check_shape(loaded, (shard.full_rows, *columns))
        part = narrow(loaded, 0, shard.start, shard.rows)
        row = sum(s.rows for s in shards[:i])  # after the earlier parts' rows
        if param is self.bias:
            param.data[row : row + shard.rows].copy_(part)
        else:
            self.quant_method.load_weight(self, part, row)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of one input as one matmul (gate_up_proj): each rank
    holds its share of every part, part after part."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        shards = [even_shard(n, f"{prefix or 'a layer'}'s output rows") for n in output_sizes]
        super().__init__(
            input_size, sum(output_sizes), bias, dtype, quant_config, prefix, output_shards=shards
        )


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v as one matmul, split by attention heads (HeadShard: query heads with their KV
    head; with fewer KV heads than ranks, each replicated on several)."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        d = head_size
        heads = HeadShard.of(total_num_heads, total_num_kv_heads, tp_group())
        q = Shard(total_num_heads * d, heads.q_start * d, heads.num_heads * d)
        kv = Shard(total_num_kv_heads * d, heads.kv_start * d, heads.num_kv_heads * d)
        output_size = (total_num_heads + 2 * total_num_kv_heads) * d
        super().__init__(
            hidden_size, output_size, bias, dtype, quant_config, prefix, output_shards=[q, kv, kv]
        )
        self.head_shard = heads
        self.q_size, self.kv_size = q.rows, kv.rows  # this rank's

    @property
    def output_columns(self) -> tuple[int, int]:
        """(first, count) of the attention output's columns this rank's query heads give: the
        input columns of the o_proj after it."""
        return self.output_shards[0].start, self.output_shards[0].rows


class RowParallelLinear(LinearBase):
    """The input columns split across ranks (evenly, unless input_shard says how); the partial
    outputs summed by an all-reduce (unless reduce_results is False), the bias added once, by
    rank 0, before it."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        *,
        input_shard: tuple[int, int] | None = None,
        reduce_results: bool = True,
    ):
        if input_shard is None:
            input_shard = split(input_size, f"{prefix or 'a layer'}'s input columns")
        super().__init__(
            input_size, output_size, input_shard=input_shard,
            output_shards=[Shard(output_size, 0, output_size)], bias=bias, dtype=dtype,
            quant_config=quant_config, prefix=prefix,
        )  # fmt: skip
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int | None = None):
        if param is self.bias:  # every rank holds it; rank 0 adds it
            check_shape(loaded, (self.output_size,))
            param.data.copy_(loaded)
            return
        check_shape(loaded, (self.output_size, self.input_size))
        part = narrow(loaded, 1, self.input_start, self.input_size_per_partition)
        self.quant_method.load_weight(self, part, 0)

    @property
    def forward_bias(self) -> torch.Tensor | None:
        return self.bias if tp_group().rank == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.forward_bias)
        if self.lora is not None:  # this rank's input columns: a partial sum, reduced with y's
            self.lora.apply(y, x)
        return all_reduce(y) if self.reduce_results else y


@torch.inference_mode()
def warm_packed_products(
    model: nn.Module, max_rows: int, head: nn.Module | None = None, max_head_rows: int = 0
) -> int:
    """Runs each distinct oneDNN-packed product of `model` (bfloat16 on CPU) once at every row
    count it runs at (unquantized.padded_rows) up to max_rows, `head`'s up to max_head_rows.
    oneDNN makes a primitive per shape on its first use (about half a MiB of JIT code and state)
    and keeps it: made here, before serving, they are not memory growth under load
    (docs/reliability.md). Returns the number of (weight shape, row count) pairs run."""
    done: set[tuple] = set()
    for layer in model.modules():
        packed = getattr(layer, "packed_weight", None)
        if packed is None or not isinstance(layer, LinearBase):
            continue
        bias = layer.forward_bias
        key = (tuple(packed.shape), packed.dtype, None if bias is None else bias.dtype)
        limit = max_head_rows if layer is head else max_rows
        for rows in sorted({padded_rows(r) for r in range(1, limit + 1)}):
            if (key, rows) not in done:
                done.add((key, rows))
                x = torch.zeros(rows, layer.input_size_per_partition, dtype=packed.dtype)
                layer.quant_method.apply(layer, x, bias)
    return len(done)
