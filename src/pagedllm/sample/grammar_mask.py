"""Structured outputs at sampling: each constrained row's allowed tokens (its grammar's bitmask)
and the logits of the others set to -inf. The grammars are structured_output.py's (torch-free,
so the API server's process can check a schema without torch)."""

from __future__ import annotations

import torch

from pagedllm.structured_output import Grammar, token_bitmask


def grammar_bitmask(grammars: list[Grammar]) -> torch.Tensor:
    """[len(grammars), vocab / 32] int32: bit t of row i set iff grammar i allows token t."""
    return torch.from_numpy(token_bitmask(grammars))


_BIT = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, each token of logits[rows] that its grammar does not allow."""
    vocab = logits.shape[1]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    allowed = (bitmask.unsqueeze(-1) & _BIT.to(logits.device)) != 0  # [rows, words, 32]
    disallowed = ~allowed.flatten(1)  # at least the model's vocabulary wide (see ll_tokenizer)
    logits[rows] = logits[rows].masked_fill_(disallowed[:, :vocab], float("-inf"))
