"""The proposers alone (torch-free): what the n-gram and suffix proposers draft from a
sequence's tokens, what they keep and forget, and --speculative-config's checks."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.config import EngineArgs, SpeculativeConfig
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence
from pagedllm.spec_decode import make_proposer
from pagedllm.spec_decode.ngram import continuation, ngram_match
from pagedllm.spec_decode.suffix import MAX_CACHED_TOKENS, match_occurrences, walk


def config(**fields) -> SpeculativeConfig:
    return SpeculativeConfig.parse(fields)


def seq(prompt, request_id="r", n=1) -> Sequence:
    return Sequence.of(request_id, list(prompt), SamplingParams(n=n, max_tokens=100))


def propose(proposer, s: Sequence, new: list[int], batch_size=1, verified=0) -> list[int]:
    return proposer.propose([s], {s.seq_id: new}, {s.seq_id: verified}, batch_size).get(
        s.seq_id, []
    )


# -- n-gram ---------------------------------------------------------------------------------------
def test_ngram_takes_the_longest_n_then_the_latest_occurrence():
    tokens = np.array([1, 2, 9, 7, 2, 8, 1, 2, 5, 1, 2])
    # "1 2" occurs at 0 (then 9) and at 6 (then 5): the latest wins.
    assert ngram_match(tokens, 2, 4) == 8
    # A longer match beats a later, shorter one.
    tokens = np.array([4, 1, 2, 3, 9, 1, 2, 6, 4, 1, 2])
    assert ngram_match(tokens, 1, 3) == 3  # "4 1 2" at 0, not "1 2" at 5
    assert ngram_match(tokens, 1, 2) == 7  # bigrams only: the latest
    assert ngram_match(np.array([1, 2, 3, 4]), 1, 3) is None
    assert ngram_match(np.array([7]), 1, 3) is None


def test_ngram_continuation_repeats_a_loop_past_the_end():
    tokens = np.array([5, 1, 2, 3, 1, 2, 3, 1, 2])
    start = ngram_match(tokens, 2, 2)
    assert continuation(tokens, start, 7) == [3, 1, 2, 3, 1, 2, 3]
    assert continuation(np.array([4, 5, 6, 7, 8]), 1, 3) == [5, 6, 7]


def test_ngram_proposer_follows_the_sequence_as_it_grows():
    proposer = make_proposer(config(method="ngram", num_speculative_tokens=3))
    s = seq([10, 11, 12, 13, 10])
    assert propose(proposer, s, [11]) == [12, 13, 10]  # "10 11" seen before
    s.append_output_token(11)  # what the scheduler does with the step's token
    assert propose(proposer, s, [99]) == []  # "11 99" never seen
    assert proposer.histories[s.seq_id].tokens.tolist() == [10, 11, 12, 13, 10, 11, 99]
    proposer.finish(["r"])
    assert not proposer.histories and not proposer._seq_ids


def test_drafts_follow_how_the_last_ones_fared():
    """Rejected after m accepted: the next draft is capped at m + 1; accepted whole: the cap
    doubles; accepted rarely: a draft only every PROBE_EVERY steps."""
    proposer = make_proposer(config(method="ngram", num_speculative_tokens=4))
    s = seq([1, 2, 3, 4] * 3)

    def step(new, verified):
        drafts = propose(proposer, s, new, verified=verified)
        for t in new:
            s.append_output_token(t)
        return drafts

    assert step([1], 0) == [2, 3, 4, 1]
    assert step([2, 3], 4) == [4, 1]  # 1 of 4 accepted: cap 2
    assert step([4, 1, 2], 2) == [3, 4, 1, 2]  # both accepted: cap 4
    drafted = [step([3], 4), step([4], 1), step([1], 1)]  # none accepted: cap 1, then ...
    assert drafted == [[4], [1], []]  # ... the moving average falls below MIN_ACCEPTANCE
    idle = [step([t], 0) for t in [2, 3, 4, 1, 2, 3, 4]]
    assert idle == [[]] * 6 + [[1]]  # a probe, PROBE_EVERY steps after the last draft


def test_no_drafts_for_beam_search_a_group_s_first_token_or_a_large_batch():
    proposer = make_proposer(
        config(method="ngram", num_speculative_tokens=2, disable_by_batch_size=4)
    )
    loop = [1, 2, 1, 2, 1]
    assert propose(proposer, seq(loop), [2], batch_size=4) == [1, 2]
    assert propose(proposer, seq(loop, "b"), [2], batch_size=5) == []
    assert propose(proposer, seq(loop, "c", n=3), [2, 2, 2]) == []  # forks into 3
    beam = Sequence.of(
        "d", loop, SamplingParams(use_beam_search=True, n=2, max_tokens=5, temperature=0)
    )
    assert propose(proposer, beam, [2]) == []


# -- suffix ---------------------------------------------------------------------------------------
def test_suffix_match_finds_the_longest_suffix_with_a_continuation():
    corpus = np.array([1, 2, 3, 4, 9, 2, 3, 4, 7, 3, 4])
    starts, length = match_occurrences(corpus, np.array([8, 2, 3, 4]), max_depth=24)
    assert length == 3 and starts.tolist() == [4, 8]  # "2 3 4" twice, then 9 and 7
    starts, length = match_occurrences(corpus, np.array([2, 3, 4]), max_depth=2)
    assert length == 2 and starts.tolist() == [4, 8]  # depth 2: "3 4"
    assert match_occurrences(corpus, np.array([5]), 24)[1] == 0


def test_suffix_walk_takes_the_most_frequent_continuation_while_likely():
    # After "1": 2 three times (each then 3), 5 once.
    corpus = np.array([1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 5])
    starts = np.flatnonzero(corpus == 1) + 1
    tokens, score = walk(corpus, starts, max_tokens=5, min_prob=0.1)
    assert tokens == [2, 3, 0, 1, 2]  # 2 after 1: 3 of 4; then certain; then 2 of 3
    assert score == pytest.approx(0.75 * 4 + 0.5)
    assert walk(corpus, starts, 5, min_prob=0.8)[0] == []  # 0.75 < 0.8: nothing
    assert walk(corpus, starts, 2, 0.1)[0] == [2, 3]


def test_suffix_proposer_uses_finished_outputs_and_bounds_them():
    proposer = make_proposer(
        config(method="suffix", num_speculative_tokens=8, suffix_decoding_max_cached_requests=2)
    )
    first = seq([50, 51], "a")
    propose(proposer, first, [60, 61, 62, 63, 64, 65])
    proposer.finish(["a"])  # its output (60..65) is cached, not its prompt
    assert proposer._cache().tolist() == [60, 61, 62, 63, 64, 65, -1]
    # A new request that ends like that output gets its continuation, as long as the match.
    other = seq([70, 60, 61], "b")
    assert propose(proposer, other, [62]) == [63, 64, 65]
    for name in ("c", "d"):
        s = seq([1], name)
        propose(proposer, s, [80, 81])
        proposer.finish([name])
    assert len(proposer._cached) == 2 and 60 not in proposer._cache().tolist()
    proposer.finish(["b"])
    assert not proposer.histories


def test_suffix_cache_stays_under_its_token_bound():
    proposer = make_proposer(config(method="suffix", num_speculative_tokens=4))
    for i in range(3):
        s = seq([1], str(i))
        propose(proposer, s, list(range(MAX_CACHED_TOKENS // 2 + 10)))
        proposer.finish([str(i)])
    assert proposer._cached_tokens <= MAX_CACHED_TOKENS
    assert len(proposer._cache()) <= MAX_CACHED_TOKENS + len(proposer._cached)


# -- --speculative-config -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, message",
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "must be >= 1"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown field"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
            '"prompt_lookup_max": 3}',
            "prompt_lookup_min",
        ),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "min_token_prob"),
        ("ngram", "not valid JSON"),
    ],
)
def test_bad_configs_are_refused_naming_the_flag(value, message):
    with pytest.raises(ValueError, match=message) as info:
        EngineArgs(speculative_config=value).validate()
    assert "--speculative-config" in str(info.value)


def test_config_defaults_and_cli_round_trip():
    c = config(method="ngram", num_speculative_tokens=3, prompt_lookup_max=6)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 6)
    assert config(method="suffix").num_speculative_tokens == 24
    assert c.disable_by_batch_size == 32  # measured: docs/speculative_decoding.md
    assert config(method="suffix", disable_by_batch_size=None).disable_by_batch_size is None
    args = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    flag = args.to_cli_args()
    assert flag[0] == "--speculative-config"
    assert SpeculativeConfig.parse(flag[1]) == SpeculativeConfig.parse(args.speculative_config)


def test_stats_line_is_vllm_s():
    from pagedllm.entrypoints.openai.metrics import spec_decode_line

    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens")  # fmt: skip
    before = {**dict.fromkeys(keys, 0), "spec_decode_num_accepted_tokens_per_pos": [1]}
    after = {"spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 12,
             "spec_decode_num_accepted_tokens": 6,
             "spec_decode_num_accepted_tokens_per_pos": [4, 2, 1]}  # fmt: skip
    line = spec_decode_line(before, after, 2.0)
    assert line.startswith("SpecDecoding metrics: Mean acceptance length: 2.50, ")
    assert "Accepted throughput: 3.00 tokens/s, Drafted throughput: 6.00 tokens/s" in line
    assert "Per-position acceptance rate: 0.750, 0.500, 0.250" in line
    assert line.endswith("Avg Draft acceptance rate: 50.0%")
    assert spec_decode_line(after, after, 2.0) is None  # no drafts in the interval
