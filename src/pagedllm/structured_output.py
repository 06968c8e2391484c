"""Structured outputs: decoding constrained by a grammar (JSON schema, regex, choice, Lark/GBNF).

llguidance (a Rust grammar engine with Python bindings) compiles the request's constraint once,
against the model's tokenizer, into a matcher. Before each sampled token the matcher gives the
tokens that keep the output a prefix of some sentence of the grammar, as a bitmask over the
vocabulary (one bit per token); the sampler sets every other logit to -inf. After sampling, the
matcher consumes the token. Once the grammar can take nothing more the sequence stops.

Why llguidance: it installs here with no dependencies (xgrammar needs transformers and Triton at
run time), builds its tokenizer straight from the `tokenizers` JSON we already load, compiles a
JSON schema in about a millisecond, and computes a mask in about 0.1 ms for this vocabulary,
lazily (its lexer and Earley parser work on the fly, so there is no per-schema automaton to build
over the whole vocabulary first).
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy  # not llguidance.torch: it imports torch.compile's stack (~5 s at start-up)
import numpy as np

if TYPE_CHECKING:
    from pagedllm.model_loader.tokenizer import Tokenizer
    from pagedllm.sampling_params import StructuredOutputsParams

# Whitespace JSON output may hold between tokens. Not unbounded: a small model can otherwise
# emit newlines until max_tokens and never close the object.
_JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}"}


class Grammar:
    """One sequence's position in its grammar; forked with the sequence."""

    __slots__ = ("matcher", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the bitmask's width (at least the model's vocabulary)

    def accept_token(self, token_id: int) -> None:
        # A rejected token puts the matcher in its error state, which `error` reports.
        self.matcher.consume_token(token_id)

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar would take from here (unchanged)."""
        return self.matcher.validate_tokens(token_ids)

    def is_terminated(self) -> bool:
        """Nothing but EOS can follow: the output is complete."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """The matcher's error, first line (the rest is llguidance's parser state dump)."""
        if not self.matcher.is_error():
            return None
        return self.matcher.get_error().split("\n", 1)[0]

    def fork(self) -> Grammar:
        return Grammar(self.matcher.deep_copy(), self.vocab_size)


class StructuredOutputManager:
    """Compiles requests' constraints against one tokenizer (built on first use: ~0.2 s)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # grammars compile on the server's compile threads

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            return self._build_ll_tokenizer()

    def _build_ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            backend = self._tokenizer.backend
            # The model may pad its vocabulary past the tokenizer's: those ids are never allowed.
            n_vocab = max(self.vocab_size, backend.get_vocab_size(with_added_tokens=True))
            self._ll_tokenizer = llguidance.LLTokenizer(
                backend.to_str(), n_vocab=n_vocab, eos_token=self._eos_token_ids or None
            )
        return self._ll_tokenizer

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """A matcher at the start of the constraint; ValueError for one that does not compile.
        Safe from any thread (llguidance releases the GIL while it compiles)."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, _grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {params.kind} for structured outputs: {matcher.get_error()}")
        grammar = Grammar(matcher, self.ll_tokenizer.vocab_size)
        # A constraint whose language is empty (`start: start`, a schema that only refers to
        # itself) compiles, then allows no first token: refuse it now, not mid-decode.
        token_bitmask([grammar])
        if grammar.error is not None or grammar.is_terminated():
            raise ValueError(
                f"the {params.kind} for structured outputs admits no output "
                f"({grammar.error or 'it can only be empty'})"
            )
        return grammar


def json_schema_error(schema: dict) -> str | None:
    """Why llguidance cannot compile this JSON schema, or None (no tokenizer needed)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_schema_text(schema))
    except ValueError as e:
        return str(e)
    return llguidance.LLMatcher.validate_grammar(grammar) or None


def _schema_text(schema: dict) -> str:
    """The schema as JSON text. llguidance is handed text, never the dict: converting a deeply
    nested dict recurses in native code and overflows its stack (a crash, at ~10,000 levels),
    while text goes through a parser with a depth limit that reports an error."""
    try:
        return json.dumps(schema)
    except (RecursionError, TypeError, ValueError) as e:
        raise ValueError(f"the JSON schema cannot be serialized: {e}") from None


def lark_json(schema: dict) -> str:
    """A Lark rule body matching JSON valid under `schema`, with pagedllm's JSON whitespace."""
    return f"%json {_schema_text({**schema, 'x-guidance': _JSON_OPTIONS})}"


def _grammar_text(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        options = {"whitespace_flexible": False} if params.disable_any_whitespace else _JSON_OPTIONS
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                _schema_text(schema), defaults=options
            )
        except ValueError as e:  # not JSON, or not an object
            raise ValueError(f"invalid json schema for structured outputs: {e}") from None
    if kind == "regex":
        # \d as [0-9]: Rust's Unicode \d would also take digits of other scripts.
        return llguidance.LLMatcher.grammar_from_lark(
            f"start: /{llguidance.regex_to_lark(params.regex, 'd')}/"
        )
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice)
        )
    # Lark (llguidance's syntax) when it has a `start:` rule or `%llguidance`, else llama.cpp's
    # GBNF (converted to Lark).
    try:
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise ValueError(f"invalid grammar for structured outputs: {e}") from None


def token_bitmask(grammars: list[Grammar]) -> np.ndarray:
    """[len(grammars), vocab / 32] int32: bit t of row i set iff grammar i allows token t."""
    bitmask = llguidance.numpy.allocate_token_bitmask(len(grammars), grammars[0].vocab_size)
    # One row after another: llguidance's thread pool (fill_next_token_bitmask_par) measured
    # slower here (2 cores, shared with torch's threads): 3.4 vs 1.7 ms a step for 8 rows.
    for row, grammar in enumerate(grammars):
        llguidance.numpy.fill_next_token_bitmask(grammar.matcher, bitmask, row)
    return bitmask
