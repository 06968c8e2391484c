"""KV cache groups with sliding windows: blocks that leave the window are released, while every
query still reads exactly its window's K/V. Torch-free: a fake runner keeps a simulated pool (a
slot holds the (group, position, token) written there) and derives each next token from what
the last query of each group reads back through that group's block table, so a block released
too early (and reused) or a wrong table entry changes the output, which is compared with a
reference computed from the token list alone."""

import hashlib
import itertools

import pytest

from pagedllm.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from pagedllm.core.kv_cache_spec import KVCacheSpec, cdiv
from pagedllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence

VOCAB = 40
_ids = itertools.count()


def h(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def next_token(windows, tokens, sample_index) -> int:
    """The fake model: what each group's last query sees (everything, or its window)."""
    views = tuple(tuple(tokens if w is None else tokens[-w:]) for w in windows)
    return 1 + h(views, sample_index) % (VOCAB - 1)


def reference(windows, prompt, max_tokens, sample_index) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(windows, tokens, sample_index))
    return tokens[len(prompt) :]


class FakeRunner:
    def __init__(self, scheduler: Scheduler):
        kv = scheduler.kv_cache_manager
        self.windows = [g.sliding_window for g in kv.groups]
        self.bs = kv.block_size
        self.pool = [[None] * kv.block_size for _ in range(kv.block_pool.num_blocks)]
        self.cpu_pool = {}
        self.max_sliding_blocks = 0  # the most live blocks any sliding table held in a step

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.bs
        for dev, cpu in so.blocks_to_swap_out:  # swaps out, then in, then copies, as the runner
            self.cpu_pool[cpu] = list(self.pool[dev])
        for cpu, dev in so.blocks_to_swap_in:
            self.pool[dev] = list(self.cpu_pool[cpu])
        for src, dst in so.blocks_to_copy:
            self.pool[dst] = list(self.pool[src])
        out = ModelRunnerOutput({})
        for seq in so.scheduled_requests:
            start, n = seq.num_computed_tokens, so.num_scheduled_tokens[seq.seq_id]
            tables = so.block_ids[seq.seq_id]
            views = []
            for g, (w, table) in enumerate(zip(self.windows, tables, strict=True)):
                for p in range(start, start + n):
                    self.pool[table[p // bs]][p % bs] = (g, p, seq.all_token_ids[p])
                first = 0 if w is None else max(0, start - w + 1)  # the first query's window
                context = [self.pool[table[p // bs]][p % bs] for p in range(first, start + n)]
                expected = [(g, p, seq.all_token_ids[p]) for p in range(first, start + n)]
                assert context == expected, f"{seq.seq_id} reads bad K/V in group {g}"
                if w is not None:
                    live = len(tables[g]) - first // bs
                    assert live <= cdiv(w - 1 + n, bs) + 1
                    self.max_sliding_blocks = max(self.max_sliding_blocks, live)
                last = [t for _, _, t in context]
                views.append(tuple(last if w is None else last[-w:]))
            if not so.needs_sample(seq):
                continue
            indices = range(seq.num_samples) if seq.num_samples > 1 else [seq.sample_index]
            tokens = seq.all_token_ids[: start + n]
            out.sampled_token_ids[seq.seq_id] = [
                next_token(self.windows, tokens, i) for i in indices
            ]
        return out


def make_request(prompt, max_tokens, n=1) -> Sequence:
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, seed=0)
    return Sequence.of(f"r{next(_ids)}", prompt, params, eos_token_ids=[0])


def run(windows, requests, num_blocks, block_size=4, budget=16, mode="recompute", cpu=0,
        max_steps=2000):  # fmt: skip
    kv = KVCacheManager(num_blocks, block_size, True, cpu, windows)
    s = Scheduler(SchedulerConfig(8, budget, 128, preemption_mode=mode), kv)
    runner = FakeRunner(s)
    for r in requests:
        s.add_request(r)
    outputs = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        s.check_integrity()
        for group in s.update_from_output(so, runner.execute(so)):
            for seq in group.seqs + group.finished_seqs:
                outputs[(group.request_id, seq.sample_index)] = seq.output_token_ids
        s.check_integrity()
    assert not s.has_unfinished_requests(), "did not finish"
    assert kv.num_free_blocks == num_blocks, "blocks leaked"
    return outputs, s, runner


def prompt(n, seed):
    return [1 + h(seed, j) % (VOCAB - 1) for j in range(n)]


WINDOWS = [None, 6, 6]  # one full-attention group, two sliding groups


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("num_blocks", [200, 48, 40])
def test_outputs_equal_reference_under_pressure(mode, num_blocks):
    """Long and short prompts, n > 1 (shared tables, copy-on-write), repeated prefixes (hits
    that end inside the window), chunked prefill and, in the small pools, preemption. Every
    group fits the smallest pool at its peak (as the engine's admission check requires)."""
    shared = prompt(30, "shared")
    specs = [
        (shared + prompt(3, 1), 20, 1),
        (prompt(45, 2), 25, 1),
        (shared[:12] + prompt(2, 3), 8, 2),
        (prompt(5, 4), 10, 3),
        (shared, 10, 1),
    ]
    for p, m, n in specs:
        spec_blocks = n * sum(
            cdiv(len(p) + m, 4) if w is None else min(cdiv(len(p) + m, 4), cdiv(w - 1 + 16, 4) + 1)
            for w in WINDOWS
        )
        assert spec_blocks <= 40
    requests = [make_request(p, m, n) for p, m, n in specs]
    outputs, s, runner = run(WINDOWS, requests, num_blocks, mode=mode, cpu=64)
    for r, (p, m, n) in zip(requests, specs, strict=True):
        for i in range(n):
            want = reference(WINDOWS, p, m, i if n > 1 else 0)
            assert outputs[(r.request_id, i)] == want, (r.request_id, i)
    if num_blocks == 40:
        assert s.num_preemptions_total > 0  # the small pool really was under pressure
    assert runner.max_sliding_blocks > 0


def test_sliding_tables_stay_bounded_and_the_pool_holds_what_full_attention_cannot():
    """A 100-token request needs 25 blocks per group with full attention (75 for three groups);
    with windows of 6 each sliding table keeps at most 3 blocks while decoding (5 during its
    8-token prefill chunks), so 34 blocks suffice, without a single preemption."""
    windows = [None, 6, 6]
    r = make_request(prompt(40, "long"), 60)
    outputs, s, runner = run(windows, [r], num_blocks=34, budget=8)
    assert outputs[(r.request_id, 0)] == reference(windows, r.prompt_token_ids, 60, 0)
    assert s.num_preemptions_total == 0
    assert runner.max_sliding_blocks <= cdiv(6 - 1 + 8, 4) + 1


def test_released_entries_are_a_prefix_and_freed_blocks_stay_cached():
    kv = KVCacheManager(32, 4, True, 0, [None, 5])
    r = make_request(prompt(21, "x"), 4)
    assert kv.allocate_slots(r, 21)  # the whole prompt in one step: nothing released yet
    r.num_computed_tokens = 21
    r.append_output_token(7)
    assert kv.num_free_blocks == 32 - 6 - 6
    assert kv.allocate_slots(r, 1)  # position 21 sees 17..21: blocks 0..3 are out
    full, sliding = kv.groups[0].req_to_blocks[r.seq_id], kv.groups[1].req_to_blocks[r.seq_id]
    assert len(full) == 6 and all(b is not NULL_BLOCK for b in full)
    assert sliding[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in sliding[4:]
    assert kv.num_free_blocks == 32 - 6 - 2
    assert kv.block_pool.num_cached_blocks == 5 + 5  # the released blocks are still cached
    assert kv.get_group_block_ids(r.seq_id)[1][:4] == [0, 0, 0, 0]  # read as block 0, unread
    kv.check_integrity()
    kv.free(r)
    assert kv.num_free_blocks == 32
    kv.check_integrity()


def test_prefix_hit_needs_only_the_window_before_it():
    """After the first request, its sliding blocks before the window were released and then
    evicted; a second request with the same prompt still hits up to the point where the
    window's blocks are cached."""
    windows = [None, 5]
    kv = KVCacheManager(64, 4, True, 0, windows)
    p = prompt(24, "p")
    a = make_request(p, 1)
    assert kv.allocate_slots(a, 24)
    kv.free(a)
    # Evict the sliding group's first three cached blocks (ids held in group 1's hash keys).
    sliding_hashes = [kv.groups[1]._key(bh) for bh in a.block_hashes]
    for bh in sliding_hashes[:3]:
        block = kv.block_pool.get_cached_block(bh)
        kv.block_pool._evict(block)
    b = make_request(p + [3, 4], 1)
    hits, num_hit = kv.get_computed_blocks(b)
    # 26 tokens: up to 6 full blocks; a hit of k blocks needs sliding blocks from (4k - 4) // 4.
    assert num_hit == 24
    assert hits[1][:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in hits[1][5:]
    # Drop one more sliding block inside the window: the hit shrinks to where it is not needed.
    kv.block_pool._evict(kv.block_pool.get_cached_block(sliding_hashes[5]))
    _, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 20  # k = 5 needs sliding blocks 4..4 only
    kv.block_pool._evict(kv.block_pool.get_cached_block(sliding_hashes[4]))
    _, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16  # k = 5 needs block 4 (gone); k = 4 needs block 3 only
    kv.check_integrity()


def test_spec_groups_and_sizes():
    from pagedllm.config import ModelArchConfig

    types = ["sliding_attention"] * 5 + ["full_attention"]
    config = ModelArchConfig(
        "Gemma3ForCausalLM", 100, 64, 128, 18, 4, 1, 256, sliding_window=512,
        layer_types=types * 3,
    )  # fmt: skip
    spec = KVCacheSpec.from_config(config, block_size=16, dtype_bytes=4)
    assert spec.group_size == 3 and len(spec.groups) == 6
    assert spec.groups[0].sliding_window is None and spec.groups[0].layer_ids == (5, 11, 17)
    assert sorted(i for g in spec.groups for i in g.layer_ids) == list(range(18))
    assert spec.bytes_per_block == 2 * 3 * 16 * 1 * 256 * 4
    # 32k tokens: 2048 blocks in the full group, 33 in each sliding group while decoding.
    assert spec.max_num_blocks(32768) == 2048 + 5 * 33
    plain = KVCacheSpec.from_config(
        ModelArchConfig("LlamaForCausalLM", 100, 64, 128, 4, 4, 2, 16), 16, 4
    )
    assert len(plain.groups) == 1 and plain.group_size == 4
    assert plain.max_num_blocks(100) == 7
