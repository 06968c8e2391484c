"""Speculative decoding's proposers: after a step, each sampled sequence gets draft tokens for
the next step to verify (worker/model_runner.py verifies them, core/scheduler.py keeps the
accepted ones and gives the rejected ones' blocks back). Torch-free.

A proposer sees a sequence's tokens so far and the tokens this step sampled for it, and keeps
what it needs per sequence until the request finishes (`finish`)."""

from __future__ import annotations

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import Proposer


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        from pagedllm.spec_decode.ngram import NgramProposer

        return NgramProposer(config)
    from pagedllm.spec_decode.suffix import SuffixProposer

    return SuffixProposer(config)


__all__ = ["Proposer", "make_proposer"]
