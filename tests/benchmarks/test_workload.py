"""The ShareGPT-shaped workload and the static-batch KV arithmetic. No model, no torch."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.bench.workload import (
    MIN_LEN,
    SHAREGPT_MEAN_INPUT_LEN,
    SHAREGPT_MEAN_OUTPUT_LEN,
    LengthDistribution,
    clipped_lognormal_mean,
    sharegpt_length_distributions,
    sharegpt_like_workload,
    static_batch_kv_usage,
    workload_from_tokenizer,
)

VOCAB = 1000
SPECIAL = range(17)


def _lens(workload):
    return (
        np.array([len(p) for p, _ in workload]),
        np.array([n for _, n in workload]),
    )


def test_same_seed_same_workload_other_seed_different():
    a = sharegpt_like_workload(50, VOCAB, exclude_ids=SPECIAL, seed=3)
    b = sharegpt_like_workload(50, VOCAB, exclude_ids=SPECIAL, seed=3)
    c = sharegpt_like_workload(50, VOCAB, exclude_ids=SPECIAL, seed=4)
    assert a == b
    assert a != c


def test_lengths_do_not_depend_on_vocabulary():
    a = sharegpt_like_workload(30, 1000, seed=1)
    b = sharegpt_like_workload(30, 50000, exclude_ids=SPECIAL, seed=1)
    assert [(len(p), n) for p, n in a] == [(len(p), n) for p, n in b]


def test_means_near_sharegpt_at_scale_one():
    workload = sharegpt_like_workload(20000, VOCAB, scale=1.0, seed=0)
    inp, out = _lens(workload)
    assert inp.mean() == pytest.approx(SHAREGPT_MEAN_INPUT_LEN, rel=0.15)
    assert out.mean() == pytest.approx(SHAREGPT_MEAN_OUTPUT_LEN, rel=0.15)
    # Long-tailed: the median sits well below the mean, and some requests are far longer.
    assert np.median(inp) < 0.8 * inp.mean()
    assert np.percentile(out, 99) > 2.5 * out.mean()


def test_scale_shrinks_lengths():
    full = _lens(sharegpt_like_workload(20000, VOCAB, scale=1.0, seed=0))
    quarter = _lens(sharegpt_like_workload(20000, VOCAB, scale=0.25, seed=0))
    for f, q in zip(full, quarter, strict=True):
        assert q.mean() == pytest.approx(0.25 * f.mean(), rel=0.15)
    inp, out = quarter
    assert inp.max() <= 256 and out.max() <= 256


def test_lengths_clipped():
    workload = sharegpt_like_workload(
        5000, VOCAB, scale=1.0, seed=2, max_input_len=300, max_output_len=500
    )
    inp, out = _lens(workload)
    assert inp.min() >= MIN_LEN and out.min() >= MIN_LEN
    assert inp.max() == 300 and out.max() == 500  # the tail reaches the bounds


def test_max_model_len_makes_every_request_fit():
    workload = sharegpt_like_workload(2000, VOCAB, scale=1.0, seed=0, max_model_len=512)
    assert all(len(p) + n <= 512 and len(p) < 512 and n >= 1 for p, n in workload)


def test_prompt_tokens_avoid_special_ids_and_stay_in_vocab():
    workload = sharegpt_like_workload(200, VOCAB, exclude_ids=SPECIAL, seed=0)
    ids = np.concatenate([np.array(p) for p, _ in workload])
    assert ids.min() >= 17 and ids.max() < VOCAB
    assert len(np.unique(ids)) > 0.9 * (VOCAB - 17)  # spread over the whole normal vocab


def test_workload_from_tokenizer_uses_special_ids_and_model_vocab():
    class Tok:
        vocab_size = 2000
        all_special_ids = {0, 1, 2, 1999}

    workload = workload_from_tokenizer(100, Tok(), vocab_size=1500, scale=0.5, seed=0)
    ids = np.concatenate([np.array(p) for p, _ in workload])
    assert ids.min() >= 3 and ids.max() < 1500


def test_clipped_mean_is_solved_exactly():
    dist = LengthDistribution(mean=100.0, sigma=1.2, min_len=4, max_len=300)
    assert clipped_lognormal_mean(dist.mu, 1.2, 4, 300) == pytest.approx(100.0, rel=1e-6)
    sample = dist.sample(np.random.default_rng(0), 200_000)
    assert sample.mean() == pytest.approx(100.0, rel=0.02)


def test_bad_arguments():
    with pytest.raises(ValueError, match="scale"):
        sharegpt_length_distributions(scale=0)
    with pytest.raises(ValueError, match="mean"):
        LengthDistribution(mean=500, sigma=1.0, min_len=4, max_len=100)
    with pytest.raises(ValueError, match="no ordinary token"):
        sharegpt_like_workload(1, 3, exclude_ids=[0, 1, 2])


def test_static_batch_kv_usage_hand_case():
    # (prompt_len, output_len), batch size 2 → batches [A, B], [C].
    lengths = [(10, 5), (4, 20), (7, 3)]
    usage = static_batch_kv_usage(lengths, batch_size=2)
    # Batch 1: 2 rows × (10 + 20) = 60 reserved; real 15 + 24 = 39.
    # Batch 2: 1 row × (7 + 3) = 10 reserved; real 10.
    assert usage.reserved_slots == 70
    assert usage.used_slots == 49
    assert usage.used_share == pytest.approx(49 / 70)
    assert usage.waste_share == pytest.approx(21 / 70)


def test_static_batch_kv_usage_no_waste_when_uniform():
    usage = static_batch_kv_usage([(8, 8)] * 5, batch_size=2)
    assert usage.reserved_slots == usage.used_slots == 80
    assert usage.waste_share == 0.0
    with pytest.raises(ValueError):
        static_batch_kv_usage([(1, 1)], batch_size=0)
