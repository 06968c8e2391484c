"""Suffix decoding (vLLM's `suffix` method, after Arctic Inference's SuffixDecoding): drafts
from the longest recent match of a sequence's last tokens, in its own tokens (prompt and
output) and in the outputs of recently finished requests, continued by the most frequent
continuation while its estimated probability stays above suffix_decoding_min_token_prob, for at
most suffix_decoding_max_spec_factor times the match's length.

The reference keeps a suffix tree of depth suffix_decoding_max_tree_depth per request and one
over cached outputs; a node is a substring, its count the occurrences that pass through it. Here
the same walk runs over the token arrays themselves: the occurrences of the matched suffix are
a numpy array of positions (the node), extending the match or the draft by one token filters
it (a step down the tree), and the counts of the tokens after them are the node's children. No
per-node memory (a Python trie costs about 200 bytes a node, and a request of L tokens has up to
L x depth of them), and the work is vectorised: one comparison over the array, then steps over
the occurrences left."""

from __future__ import annotations

from collections import deque

import numpy as np

from pagedllm.sequence import Sequence
from pagedllm.spec_decode.proposer import MIN_ACCEPTANCE, Proposer, TokenHistory

# Most tokens of finished outputs kept for matching (besides suffix_decoding_max_cached_requests):
# one scan of them per proposal stays in the tens of microseconds.
MAX_CACHED_TOKENS = 1 << 16
_SEPARATOR = -1  # between cached outputs: no continuation crosses it


def match_occurrences(corpus: np.ndarray, context: np.ndarray, max_depth: int):
    """(positions, length): the occurrences in `corpus` of the longest suffix of `context` (at
    most `max_depth` tokens) that occurs followed by a token, as the positions of the token
    after each occurrence; length 0 when not even the last token does."""
    if not len(context) or len(corpus) < 2:
        return np.empty(0, np.int64), 0
    # Occurrences of the last token, each with a next position inside the corpus.
    ends = np.flatnonzero(corpus[:-1] == context[-1])
    length = 1
    while len(ends) and length < min(max_depth, len(context)):
        earlier = ends[ends >= length]
        longer = earlier[corpus[earlier - length] == context[-1 - length]]
        if not len(longer):
            break
        ends, length = longer, length + 1
    if not len(ends):
        return ends, 0
    return ends + 1, length


def walk(corpus: np.ndarray, starts: np.ndarray, max_tokens: int, min_prob: float):
    """The most frequent continuation from the positions `starts`: (tokens, score), the score
    the sum of each token's estimated probability (the expected number accepted). A token's
    probability is its share of the continuations at its node, times its parent's."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < max_tokens and len(starts):
        starts = starts[starts < len(corpus)]
        following = corpus[starts]
        keep = following != _SEPARATOR
        starts, following = starts[keep], following[keep]
        if not len(starts):
            break
        values, counts = np.unique(following, return_counts=True)
        best = int(np.argmax(counts))
        prob *= counts[best] / len(following)
        if prob < min_prob:
            break
        token = int(values[best])
        tokens.append(token)
        score += prob
        starts = starts[following == token] + 1
    return tokens, score


class SuffixProposer(Proposer):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self._prompt_lens: dict[str, int] = {}  # by seq id: where its output starts
        self._cached: deque[np.ndarray] = deque()  # finished outputs, oldest first
        self._cached_tokens = 0
        self._corpus: np.ndarray | None = np.empty(0, np.int64)  # None: to be rebuilt

    def _propose(self, seq: Sequence, tokens: np.ndarray) -> list[int]:
        self._prompt_lens.setdefault(seq.seq_id, seq.num_prompt_tokens)
        config = self.config
        context = tokens[-self.max_depth :]
        best: tuple[list[int], float] = ([], 0.0)
        # Its own tokens (the last one's own occurrence has no continuation), then the cache.
        for corpus in (tokens, self._cache()):
            starts, length = match_occurrences(corpus, context, self.max_depth)
            if not length:
                continue
            limit = min(self.num_speculative_tokens,
                        int(config.suffix_decoding_max_spec_factor * length))  # fmt: skip
            proposal = walk(corpus, starts, limit, config.suffix_decoding_min_token_prob)
            if proposal[1] > best[1]:
                best = proposal
        # Fewer expected acceptances than a verified row costs: no draft.
        return best[0] if best[1] >= MIN_ACCEPTANCE else []

    def _forget(self, seq_id: str, history: TokenHistory) -> None:
        """A finished sequence's output joins the cache; the oldest leave past the bounds."""
        output = history.tokens[self._prompt_lens.pop(seq_id, history.size) :]
        if not self.max_cached_requests or not len(output):
            return
        self._cached.append(output[-MAX_CACHED_TOKENS:].copy())
        self._cached_tokens += len(self._cached[-1])
        while (len(self._cached) > self.max_cached_requests
               or self._cached_tokens > MAX_CACHED_TOKENS):  # fmt: skip
            self._cached_tokens -= len(self._cached.popleft())
        self._corpus = None

    def _cache(self) -> np.ndarray:
        """The cached outputs, each followed by a separator (rebuilt after a change)."""
        if self._corpus is None:
            parts = [p for output in self._cached for p in (output, [_SEPARATOR])]
            self._corpus = np.concatenate(parts) if parts else np.empty(0, np.int64)
        return self._corpus
