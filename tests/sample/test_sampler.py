"""Sampler and SamplingMetadata against simple per-row reference implementations."""

from collections import Counter

import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import (
    Sampler,
    apply_logits_processors,
    apply_min_p,
    apply_top_k_top_p,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence

NEG_INF = float("-inf")


def req(i=0, prompt=(1, 2, 3), outputs=(), eos=(), **params):
    r = Sequence.of(f"r{i}", list(prompt), SamplingParams(**params), eos_token_ids=list(eos))
    for t in outputs:
        r.append_output_token(t)
    return r


def run(sampler, logits, requests, generators=None):
    md = SamplingMetadata.from_requests(
        requests, logits.shape[1], logits.device, generators=generators
    )
    return sampler(logits, md)


def random_logits(rows, vocab, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ---------------------------------------------------------------- references (one row at a time)


def ref_top_k(row, k):
    if k == 0 or k >= len(row):
        return set(range(len(row)))
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return {i for i, x in enumerate(row.tolist()) if x >= kth}


def ref_top_p(row, p, allowed=None):
    """Smallest set of most likely tokens (among `allowed`) whose renormalized mass reaches p."""
    allowed = set(range(len(row))) if allowed is None else allowed
    probs = torch.softmax(row.double(), dim=0).tolist()
    total = sum(probs[i] for i in allowed)
    keep, mass = set(), 0.0
    for i in sorted(allowed, key=lambda i: -probs[i]):
        keep.add(i)
        mass += probs[i] / total
        if mass >= p:
            break
    return keep


def ref_min_p(row, min_p):
    probs = torch.softmax(row.double(), dim=0).tolist()
    return {i for i, q in enumerate(probs) if q >= min_p * max(probs)}


def ref_penalties(row, prompt, outputs, presence, frequency, repetition):
    row = row.clone()
    for t in set(prompt) | set(outputs):
        if t < len(row):
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
    for t, count in Counter(outputs).items():
        row[t] -= frequency * count + presence
    return row


def kept(row):
    return set(torch.nonzero(row > NEG_INF).flatten().tolist())


# ---------------------------------------------------------------- greedy


def test_greedy_equals_argmax():
    logits = random_logits(8, 1000)
    logits[3, [10, 20, 30]] = 100.0  # ties: lowest index, like torch.argmax
    out = run(Sampler(), logits, [req(i, temperature=0.0) for i in range(8)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids[3] == 10
    assert out.logprobs is None and out.sampled_token_ranks is None


def test_greedy_rows_in_a_mixed_batch():
    logits = random_logits(6, 500)
    requests = [req(i, temperature=0.0 if i % 2 else 1.0, top_k=5) for i in range(6)]
    md = SamplingMetadata.from_requests(requests, 500, "cpu")
    assert not md.all_greedy and not md.all_random
    original = logits.clone()
    out = Sampler()(logits, md)
    assert torch.equal(logits, original)  # the caller's logits are not modified
    assert torch.equal(out.sampled_token_ids[1::2], original.argmax(dim=-1)[1::2])
    for i in range(0, 6, 2):
        assert out.sampled_token_ids[i].item() in ref_top_k(original[i], 5)


def test_metadata_skips_what_no_row_needs():
    md = SamplingMetadata.from_requests([req(i, temperature=0.0) for i in range(3)], 100, "cpu")
    assert md.all_greedy and md.temperature is None and md.top_k is None and md.top_p is None
    assert md.no_penalties and md.min_tokens_mask is None and md.logit_bias is None
    assert md.max_num_logprobs is None
    md = SamplingMetadata.from_requests([req(0, top_k=-1, top_p=1.0, seed=None)], 100, "cpu")
    assert md.all_random and md.top_k is None and md.top_p is None and md.min_p is None
    assert md.generators == {}


# ---------------------------------------------------------------- top-k / top-p / min-p


def test_top_k_keeps_exactly_the_k_largest():
    vocab = 200
    logits = random_logits(7, vocab, seed=1)
    logits[6, :50] = 100.0  # 50-way tie for the top: k = 10 keeps all of it
    ks = [1, 2, 17, vocab - 1, vocab, 0, 10]  # 0 and vocab: disabled
    k = torch.tensor([vocab if x in (0, vocab) else x for x in ks])
    out = apply_top_k_top_p(logits.clone(), k, None)
    for row, x in enumerate(ks):
        assert kept(out[row]) == ref_top_k(logits[row], x)
        assert torch.equal(out[row][out[row] > NEG_INF], logits[row][out[row] > NEG_INF])
    assert len(kept(out[6])) == 50


@pytest.mark.parametrize("with_k", [False, True])
def test_top_p_keeps_the_smallest_set_reaching_p(with_k):
    vocab = 300
    ps = [0.05, 0.3, 0.5, 0.9, 0.999, 1.0, 1e-8]  # 1e-8: 1 - p rounds to 1 in float32
    ks = [vocab, 40, 3, 100, 250, 7, vocab] if with_k else [vocab] * 7
    logits = random_logits(len(ps), vocab, seed=2)
    out = apply_top_k_top_p(logits.clone(), torch.tensor(ks) if with_k else None, torch.tensor(ps))
    for row in range(len(ps)):
        allowed = ref_top_k(logits[row], ks[row])
        assert kept(out[row]) == ref_top_p(logits[row], ps[row], allowed)


def test_min_p_keeps_tokens_above_the_scaled_max():
    logits = random_logits(5, 100, seed=3)
    ps = [0.0, 0.01, 0.1, 0.5, 1.0]
    out = apply_min_p(logits.clone(), torch.tensor(ps))
    for row, p in enumerate(ps):
        assert kept(out[row]) == ref_min_p(logits[row], p)


# ---------------------------------------------------------------- penalties, bias, min_tokens


def test_penalties_match_reference():
    vocab = 50
    logits = random_logits(5, vocab, seed=4)
    specs = [
        dict(prompt=(1, 2, 2, 7, 60), outputs=(7, 7, 3, 9, 3, 7), repetition_penalty=1.3),
        dict(prompt=(4, 5), outputs=(5, 5, 6), presence_penalty=0.7, frequency_penalty=0.4),
        dict(prompt=(0, 1), outputs=(2, 2), temperature=0.0),  # no penalties: untouched
        dict(prompt=(8,), outputs=(8, 11, 11, 12), repetition_penalty=0.8, frequency_penalty=-0.5),
        dict(prompt=(3, 3), outputs=(), presence_penalty=1.0, repetition_penalty=1.7),
    ]
    requests = [req(i, **spec) for i, spec in enumerate(specs)]
    md = SamplingMetadata.from_requests(requests, vocab, "cpu")
    out = apply_logits_processors(logits.clone(), md)
    for row, r in enumerate(requests):
        p = r.sampling_params
        expected = ref_penalties(
            logits[row],
            r.prompt_token_ids,
            r.output_token_ids,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        torch.testing.assert_close(out[row], expected)
    assert torch.equal(out[2], logits[2])


def test_penalties_steer_greedy():
    logits = torch.zeros(1, 10)
    logits[0, 4] = 2.0
    logits[0, 5] = 1.5
    r = req(prompt=(4,), temperature=0.0, repetition_penalty=2.0)
    assert run(Sampler(), logits, [r]).sampled_token_ids.item() == 5
    r = req(prompt=(), outputs=(4,), temperature=0.0, frequency_penalty=1.0)
    assert run(Sampler(), logits, [r]).sampled_token_ids.item() == 5


def test_logit_bias():
    vocab = 30
    logits = random_logits(3, vocab, seed=5)
    biases = [{3: 100.0, 4: -5.5}, None, {0: -100.0, 29: 2.0, 99: 1.0}]  # 99: outside the vocab
    requests = [req(i, temperature=0.0, logit_bias=b) for i, b in enumerate(biases)]
    md = SamplingMetadata.from_requests(requests, vocab, "cpu")
    out = apply_logits_processors(logits.clone(), md)
    expected = logits.clone()
    for row, b in enumerate(biases):
        for t, v in (b or {}).items():
            if t < vocab:
                expected[row, t] += v
    torch.testing.assert_close(out, expected)
    assert Sampler()(logits, md).sampled_token_ids[0] == 3


def test_min_tokens_masks_eos_and_stop_ids():
    vocab = 20
    logits = torch.zeros(4, vocab)
    logits[:, [3, 5, 7]] = 10.0  # EOS 3 and stop ids 5, 7 are the most likely
    requests = [
        req(0, eos=(3,), min_tokens=2, stop_token_ids=[5, 7], temperature=0.0),
        req(1, eos=(3,), min_tokens=2, stop_token_ids=[5], outputs=(1, 2), temperature=0.0),
        req(2, eos=(3,), min_tokens=2, stop_token_ids=[5], ignore_eos=True, temperature=0.0),
        req(3, eos=(3,), min_tokens=3, stop_token_ids=[5, 7], outputs=(1, 2)),
    ]
    md = SamplingMetadata.from_requests(requests, vocab, "cpu")
    out = apply_logits_processors(logits.clone(), md)
    assert kept(out[0]) == set(range(vocab)) - {3, 5, 7}
    assert kept(out[1]) == set(range(vocab))  # min_tokens already reached
    assert kept(out[2]) == set(range(vocab)) - {5}  # ignore_eos: EOS is no stop to delay
    assert kept(out[3]) == set(range(vocab)) - {3, 5, 7}
    sampled = Sampler()(logits, md).sampled_token_ids.tolist()
    assert sampled[0] not in (3, 5, 7) and sampled[1] == 3 and sampled[2] == 3
    assert sampled[3] not in (3, 5, 7)


# ---------------------------------------------------------------- seeds and distributions


def test_seeded_request_independent_of_batch():
    vocab, steps = 1000, 6
    logits = [random_logits(1, vocab, seed=10 + s)[0] / 3 for s in range(steps)]  # high entropy

    def sample_steps(batch_sizes, position, sampler_seed):
        target = req(0, seed=1234, top_p=0.95)
        sampler = Sampler(seed=sampler_seed)
        tokens, generator, generators = [], None, {}
        for step, size in enumerate(batch_sizes):
            others = [req(i + 1, seed=None if i % 2 else 99 + i) for i in range(size - 1)]
            batch = others[:position] + [target] + others[position:]
            rows = random_logits(size, vocab, seed=100 + step)
            rows[min(position, size - 1)] = logits[step]
            out = run(sampler, rows, batch, generators)
            tokens.append(out.sampled_token_ids[min(position, size - 1)].item())
            target.append_output_token(tokens[-1])
            generator = generator or generators["r0"][0]
            assert generators["r0"][0] is generator  # created once, carried across steps
        return tokens

    alone = sample_steps([1] * steps, 0, sampler_seed=0)
    assert sample_steps([5, 3, 8, 2, 6, 4], 1, sampler_seed=7) == alone
    assert sample_steps([4] * steps, 3, sampler_seed=3) == alone
    # ...and the seed does matter: another seed gives another sequence.
    other = req(0, seed=4321, top_p=0.95)
    sampler = Sampler()
    tokens = [run(sampler, logits[s][None], [other]).sampled_token_ids.item() for s in range(steps)]
    assert tokens != alone


def test_seeded_generator_advances_across_steps():
    # Same flat logits every step: a generator re-seeded each step would repeat its token.
    r = req(0, seed=42)
    sampler, logits, generators = Sampler(), torch.zeros(1, 1000), {}
    tokens = []
    for _ in range(5):
        tokens.append(run(sampler, logits, [r], generators).sampled_token_ids.item())
        r.append_output_token(tokens[-1])
    assert len(set(tokens)) > 1


def test_unseeded_sampling_reproducible_per_sampler_seed():
    logits = random_logits(16, 1000) / 3
    requests = [req(i) for i in range(16)]
    a = run(Sampler(seed=5), logits, requests).sampled_token_ids
    assert torch.equal(a, run(Sampler(seed=5), logits, requests).sampled_token_ids)
    assert not torch.equal(a, run(Sampler(seed=6), logits, requests).sampled_token_ids)


def chi_square(counts, probs, n):
    expected = probs * n
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token of probability zero"
    return (((counts - expected) ** 2)[support] / expected[support]).sum().item(), int(
        support.sum()
    )


# 99.9% quantiles of chi-square with df degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.5),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.3, min_p=0.1, top_k=6, top_p=0.9),
    ],
)
def test_sampling_distribution_matches_reference(params):
    vocab, n = 8, 40000
    row = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 1.5, 0.7])
    # Reference distribution: temperature, then min_p, top_k, top_p, renormalized.
    scaled = row / params["temperature"]
    allowed = ref_min_p(scaled, params.get("min_p", 0.0)) & ref_top_k(
        scaled, params.get("top_k", 0)
    )
    allowed = ref_top_p(scaled, params.get("top_p", 1.0), allowed)
    probs = torch.zeros(vocab, dtype=torch.float64)
    probs[list(allowed)] = torch.softmax(scaled.double()[list(allowed)], dim=0)

    requests = [req(0, **params)] * n  # unseeded rows: one request object can fill them all
    out = run(Sampler(seed=0), row.expand(n, vocab).clone(), requests)
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab).double()
    stat, support = chi_square(counts, probs, n)
    assert stat < CHI2_999[support - 1], (stat, counts / n, probs)


def test_seeded_rows_also_sample_the_right_distribution():
    vocab, n = 6, 4000
    row = torch.tensor([0.5, 1.5, -0.3, 0.0, 1.0, -1.0])
    probs = torch.softmax(row.double(), dim=0)
    requests = [req(i, seed=i) for i in range(n)]
    out = run(Sampler(), row.expand(n, vocab).clone(), requests)
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab).double()
    stat, support = chi_square(counts, probs, n)
    assert stat < CHI2_999[support - 1]


# ---------------------------------------------------------------- logprobs


def test_logprobs_from_raw_logits():
    vocab = 50
    logits = random_logits(4, vocab, seed=6)
    requests = [
        req(0, logprobs=0, temperature=0.7, repetition_penalty=1.5, outputs=(1, 2)),
        req(1, logprobs=3, logit_bias={0: 50.0}, temperature=0.0),
        req(2, logprobs=None, top_k=3),
        req(3, logprobs=5, temperature=2.0),
    ]
    out = run(Sampler(), logits, requests)
    raw = torch.log_softmax(logits, dim=-1)
    k = 5
    assert out.logprob_token_ids.shape == out.logprobs.shape == (4, k + 1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert out.sampled_token_ids[1] == 0  # the bias changed the choice...
    for row in range(4):
        token = out.sampled_token_ids[row].item()
        # ...but logprobs and ranks describe the raw distribution.
        torch.testing.assert_close(out.logprobs[row, 0], raw[row, token])
        top = raw[row].topk(k)
        assert torch.equal(out.logprob_token_ids[row, 1:], top.indices)
        torch.testing.assert_close(out.logprobs[row, 1:], top.values)
        expected_rank = 1 + sorted(raw[row].tolist(), reverse=True).index(raw[row, token].item())
        assert out.sampled_token_ranks[row].item() == expected_rank
    assert out.sampled_token_ranks[1].item() > 1


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = random_logits(2, 20, seed=7)
    out = run(Sampler(), logits, [req(0, logprobs=0, temperature=0.0), req(1)])
    assert out.logprobs.shape == (2, 1)
    assert torch.equal(out.sampled_token_ranks[:1], torch.tensor([1]))


def test_top_p_keeps_tokens_tied_at_the_cutoff():
    logits = torch.zeros(1, 10)
    logits[0, 0] = 1.0
    # The top token has ~23% of the mass, so p = 0.5 needs some of the nine tied tokens: all stay
    # rather than an arbitrary few.
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.5]))
    assert kept(out[0]) == set(range(10))
    assert kept(apply_top_k_top_p(logits.clone(), None, torch.tensor([0.2]))[0]) == {0}
    # 1 - 1e-8 rounds to 1 in float32, so the whole row sums to <= 1 - p: the top token stays.
    assert kept(apply_top_k_top_p(logits.clone(), None, torch.tensor([1e-8]))[0]) == {0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_matches_the_rules():
    vocab, device = 32000, torch.device("cuda")
    logits = random_logits(8, vocab).to(device)
    requests = [
        req(i, temperature=0.0 if i % 3 == 0 else 0.8, top_p=0.9, top_k=50, logprobs=2)
        for i in range(7)
    ]
    seeded = req(7, seed=5, min_p=0.05, repetition_penalty=1.2, outputs=(1, 2))
    out = run(Sampler(), logits, requests + [seeded])
    processed = apply_logits_processors(
        logits.clone(), SamplingMetadata.from_requests(requests + [seeded], vocab, device)
    )
    assert torch.equal(out.sampled_token_ids[::3], processed.argmax(dim=-1)[::3])
    torch.testing.assert_close(
        out.logprobs[:, 0],
        torch.log_softmax(logits, -1).gather(1, out.sampled_token_ids[:, None])[:, 0],
    )
    alone = req(7, seed=5, min_p=0.05, repetition_penalty=1.2, outputs=(1, 2))
    assert (
        run(Sampler(seed=3), logits[7:], [alone]).sampled_token_ids[0] == out.sampled_token_ids[7]
    )


def test_argmax_helper_is_torch_argmax_with_ties_and_nan():
    from pagedllm.sample.sampler import argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (64, 1000), generator=g).float()  # many ties: first index wins
    x[3, 17] = float("nan")  # NaN counts as the maximum
    x[5] = float("-inf")
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    y = torch.randn(7, 49152, generator=g)
    assert torch.equal(argmax(y), y.argmax(dim=-1))
