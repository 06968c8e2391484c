"""BeamSearchState against independent references: an exhaustive enumeration, a plain-Python
transcription of HF transformers' vectorized `_beam_search` (fixed beam slots, -1e9 masks), and
small hand-checked cases. No torch."""

import hashlib
import itertools
import math
import random
from dataclasses import dataclass, field

import pytest

from pagedllm.core.beam_search import BeamSearchState

NEG = -1.0e9


@dataclass
class Beam:
    output_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    output_logprobs: list = field(default_factory=list)


def table_model(vocab: int, seed: int, eos_boost: float = 0.0, eos=(0,)):
    """A deterministic 'model': next-token logprobs as a function of the tokens so far."""

    def logprobs(tokens) -> list[float]:
        digest = hashlib.sha256(repr((seed, tuple(tokens))).encode()).digest()
        rng = random.Random(digest)
        logits = [rng.gauss(0.0, 2.0) for _ in range(vocab)]
        for t in eos:
            logits[t] += eos_boost
        m = max(logits)
        log_z = m + math.log(sum(math.exp(x - m) for x in logits))
        return [x - log_z for x in logits]

    return logprobs


def run_ours(model, width, max_tokens, length_penalty, early_stopping, eos, k=None):
    """Drive BeamSearchState the way the scheduler does; returns (state, number of steps)."""
    state = BeamSearchState(width, max_tokens, length_penalty, early_stopping, eos)
    k = k or state.num_candidates
    beams = [Beam()]
    steps = 0
    while not state.done:
        candidates = []
        for beam in beams:
            lps = model(beam.output_token_ids)
            order = sorted(range(len(lps)), key=lambda t: -lps[t])[:k]
            candidates.append((order, [lps[t] for t in order]))
        chosen = state.step(beams, candidates, steps)
        steps += 1
        beams = [
            Beam([*beams[c.parent].output_token_ids, c.token_id], c.cumulative_logprob)
            for c in chosen
        ]
        assert len(beams) <= width
    return state, steps


def hf_reference(model, vocab, width, max_tokens, length_penalty, early_stopping, eos):
    """HF transformers' `_beam_search` for one prompt, slot for slot, in plain Python.

    Returns [(tokens, score)] best first, and the number of steps."""
    num_keep = max(2, 1 + len(eos)) * width
    running = [([], 0.0)] + [([], NEG)] * (width - 1)
    finished = [([], NEG, False)] * width  # (tokens, score, is finished)
    heuristic_unsatisfied = True
    cur = 0  # tokens generated so far
    while True:
        flat = []
        for b, (tokens, score) in enumerate(running):
            lps = model(tokens)
            for t in range(vocab):
                flat.append((score + lps[t], b * vocab + t, [*tokens, t]))
        # torch.topk: highest first; ties broken towards the lower flat index here.
        top = sorted(flat, key=lambda x: (-x[0], x[1]))[:num_keep]
        hits = [cur + 1 >= max_tokens or seq[-1] in eos for _, _, seq in top]
        # e. the running beams for the next step
        masked = [
            (s + (NEG if h else 0.0), i, seq) for (s, i, seq), h in zip(top, hits, strict=True)
        ]
        masked.sort(key=lambda x: -x[0])  # stable: keeps the top-k order on ties
        running = [(seq, s) for s, _, seq in masked[:width]]
        # f. the finished beams
        all_full = all(f for _, _, f in finished)
        new = []
        for rank, ((s, _, seq), h) in enumerate(zip(top, hits, strict=True)):
            score = s / ((cur + 1) ** length_penalty)
            if all_full and early_stopping is True:
                score += NEG
            if not heuristic_unsatisfied:
                score += NEG
            just_finished = h and rank < width
            if not just_finished:
                score += NEG
            new.append((seq, score, just_finished))
        merged = finished + new
        order = sorted(range(len(merged)), key=lambda i: (-merged[i][1], i))[:width]
        finished = [merged[i] for i in order]
        cur += 1
        # g. the early-stop heuristic and the loop condition
        if early_stopping == "never" and length_penalty > 0.0:
            best_len = max_tokens
        else:
            best_len = cur
        best_possible = running[0][1] / (best_len**length_penalty)
        worst = min(s for _, s, _ in finished)
        heuristic_unsatisfied = heuristic_unsatisfied and any(
            best_possible > (worst if f else NEG) for _, _, f in finished
        )
        open_beam = not (all(f for _, _, f in finished) and early_stopping is True)
        if not (heuristic_unsatisfied and open_beam and not all(hits)):
            break
    return [(tokens, score) for tokens, score, f in finished if f], cur


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 0.5, 2.0, -1.0])
def test_matches_hf_beam_search_transcription(early_stopping, length_penalty):
    vocab = 10
    cases = 0
    for seed in range(40):
        rng = random.Random(seed)
        width = rng.choice([1, 2, 3])
        eos = (0,) if seed % 3 else (0, 1)
        max_tokens = rng.randint(1, 7)
        model = table_model(vocab, seed, eos_boost=rng.choice([0.0, 1.5, 3.0]), eos=eos)
        expected, expected_steps = hf_reference(
            model, vocab, width, max_tokens, length_penalty, early_stopping, eos
        )
        state, steps = run_ours(model, width, max_tokens, length_penalty, early_stopping, eos)
        got = [(h.output_token_ids, h.score) for h in state.finished]
        assert [t for t, _ in got] == [t for t, _ in expected], (seed, width, max_tokens)
        assert [s for _, s in got] == pytest.approx([s for _, s in expected], rel=1e-9)
        assert steps == expected_steps
        for h in state.finished:
            stop = h.output_token_ids[-1] in eos
            assert h.finish_reason == ("stop" if stop else "length")
            assert h.stop_reason == (h.output_token_ids[-1] if stop else None)
            assert stop or len(h.output_token_ids) == max_tokens
            assert h.score == pytest.approx(
                h.cumulative_logprob / len(h.output_token_ids) ** length_penalty
            )
            # The cumulative logprob is the model's own sum over the generated tokens.
            toks = h.output_token_ids
            assert h.cumulative_logprob == pytest.approx(
                sum(model(toks[:i])[toks[i]] for i in range(len(toks)))
            )
        cases += 1
    assert cases == 40


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 0.7, 2.0, -0.5])
def test_wide_beam_equals_exhaustive_enumeration(early_stopping, length_penalty):
    """With a beam wider than the number of sequences nothing is pruned, so the hypotheses are
    every complete sequence (ended by EOS, or max_tokens long), ranked by the length-penalized
    score on the generated length including the EOS."""
    vocab, eos, max_tokens = 3, 0, 3
    model = table_model(vocab, 7, eos_boost=0.5)
    complete = []
    for length in range(1, max_tokens + 1):
        for seq in itertools.product(range(vocab), repeat=length):
            if eos in seq[:-1]:
                continue  # a sequence ends at its first EOS
            if length < max_tokens and seq[-1] != eos:
                continue
            cum = sum(model(seq[:i])[seq[i]] for i in range(length))
            complete.append((list(seq), cum / length**length_penalty))
    assert len(complete) == 1 + 2 + 2 * 2 * 3
    complete.sort(key=lambda x: -x[1])
    width = 16
    state, steps = run_ours(model, width, max_tokens, length_penalty, early_stopping, [eos])
    assert steps == max_tokens
    assert [h.output_token_ids for h in state.finished] == [s for s, _ in complete]
    assert [h.score for h in state.finished] == pytest.approx([s for _, s in complete])


def lp(p: float) -> float:
    return math.log(p)


def cands(*pairs):
    """(token ids, logprobs) from (token, probability) pairs, best first."""
    return [t for t, _ in pairs], [lp(p) for _, p in pairs]


EOS = 9


def test_only_the_top_width_ranks_can_finish():
    state = BeamSearchState(2, max_tokens=10, stop_token_ids=[EOS])
    assert state.num_candidates == 4
    root = Beam()
    # Ranks: 1 (0.5), 2 (0.3), EOS at rank 3 (0.15): not among the top 2, so not a hypothesis.
    chosen = state.step([root], [cands((1, 0.5), (2, 0.3), (EOS, 0.15), (3, 0.05))], 0)
    assert state.finished == []
    assert [(c.parent, c.token_id) for c in chosen] == [(0, 1), (0, 2)]
    assert [c.rank for c in chosen] == [1, 2]
    beams = [Beam([1], lp(0.5)), Beam([2], lp(0.3))]
    # Now EOS ranks first overall (beam 0): it finishes, and the next two best continue.
    chosen = state.step(
        beams, [cands((EOS, 0.9), (4, 0.05), (5, 0.05)), cands((6, 0.6), (7, 0.4))], 1
    )
    assert [h.output_token_ids for h in state.finished] == [[1, EOS]]
    hyp = state.finished[0]
    assert hyp.finish_reason == "stop" and hyp.stop_reason == EOS
    assert hyp.cumulative_logprob == pytest.approx(lp(0.5) + lp(0.9))
    assert hyp.score == pytest.approx((lp(0.5) + lp(0.9)) / 2)  # EOS counts in the length
    assert [(c.parent, c.token_id) for c in chosen] == [(1, 6), (1, 7)]
    assert not state.done


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_length_penalty_scores_the_generated_length(length_penalty):
    state = BeamSearchState(1, max_tokens=10, length_penalty=length_penalty, stop_token_ids=[EOS])
    beam = Beam([3, 4, 5], -1.5)  # three tokens generated; the prompt length plays no part
    state.step([beam], [cands((EOS, 0.5), (6, 0.4))], 3)
    (hyp,) = state.finished
    assert hyp.output_token_ids == [3, 4, 5, EOS]
    assert hyp.score == pytest.approx((-1.5 + lp(0.5)) / 4**length_penalty)


def two_finished_then(early_stopping, length_penalty=1.0, max_tokens=10, running_p=0.7):
    """Width 2: step 1 gives beams [1] (0.6) and [2] (0.4); step 2 finishes [1, EOS] and
    [2, EOS] (both in the top 2 ranks) while beam [1] also continues with token 3 at rank 3.
    Returns the state after step 2 and the chosen continuations."""
    state = BeamSearchState(2, max_tokens, length_penalty, early_stopping, [EOS])
    state.step([Beam()], [cands((1, 0.6), (2, 0.4))], 0)
    beams = [Beam([1], lp(0.6)), Beam([2], lp(0.4))]
    chosen = state.step(
        beams,
        [cands((EOS, 0.9), (3, 1 - 0.9)), cands((EOS, 0.95), (4, 0.05))],
        1,
    )
    return state, chosen


def test_early_stopping_true_stops_once_width_hypotheses_are_finished():
    state, chosen = two_finished_then(True)
    assert len(state.finished) == 2
    assert state.done and chosen == []


def test_early_stopping_false_uses_the_current_length_heuristic():
    # Finished: [1, EOS] = ln(.54)/2 = -0.308, [2, EOS] = ln(.38)/2 = -0.484. Best running:
    # [1, 3] = ln(.06) = -2.81, at the current length 2: -1.41 < -0.484, so nothing can improve.
    state, chosen = two_finished_then(False)
    assert len(state.finished) == 2
    assert state.done and chosen == []
    # A penalty of -3 favours short sequences: scored at the current length, the running beam
    # (ln(.06) * 2**3 = -22.5) is worse than the worst finished one (ln(.38) * 8 = -7.7): done.
    state, _ = two_finished_then(False, length_penalty=-3.0)
    assert state.done


def test_early_stopping_never_judges_at_max_tokens_with_a_positive_penalty():
    # Length penalty 2, max_tokens 10: the worst finished scores ln(.38)/4 = -0.24; the best
    # running beam at the current length: ln(.06)/4 = -0.70 (False stops), but at length 10:
    # ln(.06)/100 = -0.028, which could still win ("never" goes on).
    state, _ = two_finished_then(False, length_penalty=2.0)
    assert state.done
    state, chosen = two_finished_then("never", length_penalty=2.0)
    assert not state.done
    assert [(c.parent, c.token_id) for c in chosen] == [(0, 3), (1, 4)]
    # With a non-positive penalty "never" falls back to the current length, like False.
    state, _ = two_finished_then("never", length_penalty=0.0)
    assert state.done


def test_max_tokens_ends_every_beam():
    state = BeamSearchState(2, max_tokens=2, stop_token_ids=[EOS])
    chosen = state.step([Beam()], [cands((1, 0.6), (2, 0.4))], 0)
    assert len(chosen) == 2 and not state.done
    beams = [Beam([1], lp(0.6)), Beam([2], lp(0.4))]
    chosen = state.step(beams, [cands((5, 0.7), (6, 0.3)), cands((7, 0.9), (EOS, 0.1))], 1)
    assert state.done and chosen == []
    # The top 2 of the ranked candidates finish: [2, 7] (.36) and [1, 5] (.42), by "length".
    assert [h.output_token_ids for h in state.finished] == [[1, 5], [2, 7]]
    assert [h.finish_reason for h in state.finished] == ["length", "length"]
    assert [h.stop_reason for h in state.finished] == [None, None]


def test_finished_keeps_the_best_width_and_a_better_one_displaces_the_worst():
    state = BeamSearchState(2, max_tokens=10, early_stopping="never", stop_token_ids=[EOS])
    state.step([Beam()], [cands((1, 0.5), (2, 0.5))], 0)
    beams = [Beam([1], lp(0.5)), Beam([2], lp(0.5))]
    state.step(beams, [cands((EOS, 0.5), (3, 0.5)), cands((EOS, 0.1), (4, 0.9))], 1)
    # Ranked: [2,4] .45, [1,EOS] .25, [1,3] .25, [2,EOS] .05: only [1, EOS] is in the top 2.
    assert [h.output_token_ids for h in state.finished] == [[1, EOS]]
    beams = [Beam([2, 4], lp(0.45)), Beam([1, 3], lp(0.25))]
    state.step(beams, [cands((EOS, 0.9), (5, 0.1)), cands((EOS, 0.9), (6, 0.1))], 2)
    # Per token: [2,4,EOS] ln(.405)/3 = -.30 and [1,3,EOS] ln(.225)/3 = -.50 both beat
    # [1,EOS] ln(.25)/2 = -.69, which drops out.
    assert [h.output_token_ids for h in state.finished] == [[2, 4, EOS], [1, 3, EOS]]
    assert [h.score for h in state.finished] == pytest.approx(
        [math.log(0.405) / 3, math.log(0.225) / 3]
    )
    # "never" with penalty 1: the best running beam ln(.045) could reach ln(.045)/10 = -.31.
    assert not state.done
    beams = [Beam([2, 4, 5], lp(0.045)), Beam([1, 3, 6], lp(0.025))]
    state.step(beams, [cands((EOS, 0.99), (7, 0.01)), cands((8, 0.5), (EOS, 0.5))], 3)
    # [2,4,5,EOS] finishes at rank 1 but scores ln(.04455)/4 = -.78: worse than both.
    assert [h.output_token_ids for h in state.finished] == [[2, 4, EOS], [1, 3, EOS]]
    assert not state.done


def test_logprob_records_follow_the_hypothesis():
    state = BeamSearchState(1, max_tokens=2, stop_token_ids=[EOS], num_logprobs=1)
    (c,) = state.step([Beam()], [cands((1, 0.7), (2, 0.3))], 0)
    assert c.record.token_id == 1 and c.record.rank == 1
    assert c.record.top == [(1, pytest.approx(lp(0.7)))]
    beam = Beam([1], lp(0.7), [c.record])
    state.step([beam], [cands((5, 0.6), (EOS, 0.4))], 1)
    (hyp,) = state.finished
    assert [r.token_id for r in hyp.logprobs] == [1, 5]
