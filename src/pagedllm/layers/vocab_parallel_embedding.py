"""The embedding and the LM head over this rank's rows of the vocabulary (distributed/parallel.py:
vocab_shard, the vocabulary padded to a multiple of the ranks). The embedding's tokens of other
ranks' rows embed as zeros, and the all-reduce adds the one rank's row that holds each; the
head's logits are gathered to rank 0 by the model (gather_vocab). With one rank the embedding is
nn.Embedding exactly and the head a plain linear layer."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import all_reduce, tp_group, vocab_shard
from pagedllm.layers.linear import LinearBase, Loaded, Shard
from pagedllm.layers.quantization import (
    DualLinearMethod,
    Int8ActLinearMethod,
    QuantizationConfig,
    QuantWeight,
    UnquantizedLinearMethod,
)
from pagedllm.layers.quantization.int8_act import TILE, int6_codes
from pagedllm.layers.weight_utils import check_shape, narrow


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_start, self.num_embeddings = vocab_shard(vocab_size)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings, hidden_size, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        self.tp_size = tp_group().size
        self.dtype = dtype
        self.head_codes: Callable[[], tuple] | None = None  # see gather_from
        self.codes: QuantWeight | None = None  # see take_codes
        self.takes_codes = False  # models/utils.load_weights: hand this the checkpoint's codes

    def take_codes(self) -> None:
        """An untied embedding holds the checkpoint's codes where it has them (a GGUF's Q4_K,
        Q6_K, ... blocks; one rank) instead of their float copy, and each lookup dequantizes
        the rows it needs: the same numbers, a quarter to an eighth of float32's bytes (an 8B
        Llama's 128k x 4096 embedding: 2 GiB in float32)."""
        self.takes_codes = self.tp_size == 1

    def gather_from(self, head: ParallelLMHead) -> None:
        """Look rows up in a tied head's int8 or int6 codes (layers/quantization/int8_act.py's
        layout, filled as the head loads) instead of a float copy: the same numbers (q * scale
        is exact in float32), no bytes of its own, and the checkpoint's tensor is never
        dequantized. One rank (the head's rows are then the whole vocabulary). `weight` becomes
        an empty placeholder whose loader only checks the checkpoint's shape."""
        self.head_codes = lambda: head.quant_method.codes(head)  # as they are after loading
        self.weight = nn.Parameter(torch.empty(0, dtype=self.dtype), requires_grad=False)
        self.weight.weight_loader = lambda _, loaded, shard_id=None: check_shape(
            loaded, (self.vocab_size, self.hidden_size)
        )
        self.takes_codes = True

    @property
    def nbytes(self) -> int:
        """The codes' bytes (take_codes), which are neither parameters nor buffers."""
        return 0 if self.codes is None else self.codes.nbytes

    def _rows_from_codes(self, input_ids: torch.Tensor) -> torch.Tensor:
        codes, scales, mins = self.head_codes()  # int8: no mins; int6: two scales a block
        tile, lane = input_ids // TILE, input_ids % TILE
        chunks = codes[tile, :, :, lane, :]  # [T, blocks, chunks, 4]
        q = int6_codes(chunks) if chunks.shape[2] == 6 else chunks.to(torch.int16) - 128
        scale = scales[tile, :, lane].float()  # [T, blocks] (int6: [T, 2 blocks], halves)
        rows = q.reshape(*scale.shape, -1).float() * scale[..., None]
        if mins is not None:  # int6: q * scale + min, as Int8xWeight.dequantize
            rows = rows.reshape(len(input_ids), -1, 32) + mins[tile, :, lane].float()[..., None]
        return rows.reshape(-1, self.hidden_size).to(self.dtype)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        check_shape(loaded, (self.vocab_size, self.hidden_size))
        if not isinstance(loaded, torch.Tensor):  # codes (take_codes): kept as they are
            self.codes = loaded
            self.weight = nn.Parameter(torch.empty(0, dtype=self.dtype), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
            return
        part = _rows(loaded, self.vocab_start, self.num_embeddings)
        param.data[: part.shape[0]].copy_(part)
        param.data[part.shape[0] :].zero_()  # padding rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.head_codes is not None:
            return self._rows_from_codes(input_ids)
        if self.codes is not None:
            return self.codes.rows(input_ids).dequantize().to(self.dtype)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce(out.masked_fill_(~mine[:, None], 0))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.hidden_size} (from {self.vocab_start})"


class ParallelLMHead(LinearBase):
    """hidden -> this rank's vocabulary rows of the logits (padding rows: zero weights)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "lm_head",
        tied: bool = False,
    ):
        """tied: the head's weight is the embedding's (tie_weights); a quantized one holds its
        own int8 codes of it, loaded from the embedding's checkpoint tensor."""
        start, rows = vocab_shard(vocab_size)
        super().__init__(
            hidden_size, vocab_size, input_shard=(0, hidden_size),
            output_shards=[Shard(vocab_size, start, rows)], bias=False, dtype=dtype,
            quant_config=quant_config, prefix=prefix, tied=tied,
        )  # fmt: skip

    def codes_hold_the_embedding(self) -> bool:
        """Whether this tied head's codes can serve the embedding's lookups (gather_from)."""
        method = self.quant_method
        return (
            self.tied
            and isinstance(method, Int8ActLinearMethod)
            and method.bits in (6, 8)
            and tp_group().size == 1
        )

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        if self.codes_hold_the_embedding():
            embedding.gather_from(self)
        elif isinstance(self.quant_method, UnquantizedLinearMethod):
            self.weight = embedding.weight
        elif isinstance(self.quant_method, DualLinearMethod):
            self.quant_method.tie(self, embedding.weight)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        check_shape(loaded, (self.output_size, self.input_size))
        shard = self.output_shards[0]
        part = _rows(loaded, shard.start, shard.rows)
        self.quant_method.load_weight(self, part, 0)
        padding = shard.rows - part.shape[0]
        if padding:
            zeros = torch.zeros(padding, self.input_size, dtype=torch.float32)
            self.quant_method.load_weight(self, zeros, part.shape[0])


def _rows(loaded: Loaded, start: int, rows: int) -> Loaded:
    """Rows start.. of `loaded`, as many of `rows` as there are (the last rank's are fewer)."""
    start = min(start, loaded.shape[0])
    return narrow(loaded, 0, start, min(rows, loaded.shape[0] - start))
