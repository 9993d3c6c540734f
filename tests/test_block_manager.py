"""Block manager: property tests of its invariants and unit tests of prefix-cache behaviour."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from scheduler_service import block_manager
from scheduler_service.block_manager import BlockManager, hash_block_tokens
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.sequence import Sequence

ROOT = Path(__file__).resolve().parents[1]
# Prompts drawn from a few token streams so that prefixes are often shared.
STREAMS = [[(s * 7 + i * 3) % 5 for i in range(64)] for s in range(3)]


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams())


def compute(bm: BlockManager, seq: Sequence, n: int, kv: dict[int, tuple[int, ...]]) -> None:
    """What the executor does: write the KV of n more tokens. The fake KV of a slot is the
    whole prefix up to its token, so a slot holds the right KV only for the right prefix."""
    bs = bm.block_size
    for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
        kv[seq.block_table[p // bs] * bs + p % bs] = tuple(seq.token_ids[: p + 1])
    seq.num_computed_tokens += n
    seq.num_kv_written = seq.num_computed_tokens  # and its step returned
    bm.cache_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence, chunk: int, kv: dict) -> bool:
    cached = bm.find_cached_blocks(seq)
    num_cached = len(cached) * bm.block_size
    assert num_cached < len(seq.token_ids), "the last token must always be computed"
    for i, b in enumerate(cached):
        for o in range(bm.block_size):
            p = i * bm.block_size + o
            assert kv[b * bm.block_size + o] == tuple(seq.token_ids[: p + 1]), "hit on a wrong block"
    n = min(chunk, len(seq.token_ids) - num_cached)
    if not bm.can_allocate(seq, n, cached):
        revived = sum(1 for b in cached if bm.blocks[b].ref_count == 0)
        fresh = -(-(num_cached + n) // bm.block_size) - len(cached)
        assert revived + fresh > bm.num_free_blocks
        return False
    bm.allocate(seq, n, cached)
    seq.num_computed_tokens = num_cached
    compute(bm, seq, n, kv)
    return True


class BlockManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.live: dict[int, Sequence] = {}
        self.kv: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    @rule(num_blocks=st.integers(3, 16), block_size=st.sampled_from([1, 2, 4]))
    def init(self, num_blocks, block_size):
        if self.bm is None:
            self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)

    @rule(target=seqs, stream=st.integers(0, 2), length=st.integers(1, 20), chunk=st.integers(1, 20))
    def add(self, stream, length, chunk):
        if self.bm is None:
            self.bm = BlockManager(8, 2)
        seq = make_seq(self.next_id, STREAMS[stream][:length])
        self.next_id += 1
        if admit(self.bm, seq, chunk, self.kv):
            self.live[seq.seq_id] = seq
        return seq

    @rule(seq=seqs, chunk=st.integers(1, 8), new_tokens=st.lists(st.integers(0, 4), max_size=3))
    def append(self, seq, chunk, new_tokens):
        if seq.seq_id not in self.live:
            return
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.extend(new_tokens or [0])  # "sampled" tokens
        n = min(chunk, len(seq.token_ids) - seq.num_computed_tokens)
        if self.bm.can_append(seq, n):
            new = self.bm.append_slots(seq, n)
            assert all(self.bm.blocks[b].ref_count == 1 for b in new)
            compute(self.bm, seq, n, self.kv)
        else:
            assert self.bm.num_blocks_needed(seq, n) > self.bm.num_free_blocks

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if self.live.pop(seq.seq_id, None) is not None:
            self.bm.free(seq)
            assert seq.block_table == []

    @invariant()
    def accounting(self):
        bm = self.bm
        if bm is None:
            return
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
        refs = [0] * bm.num_blocks
        for seq in self.live.values():
            assert len(set(seq.block_table)) == len(seq.block_table)
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
            for b in seq.block_table:
                refs[b] += 1
        assert refs == [b.ref_count for b in bm.blocks]
        assert set(bm.free_block_ids) == {i for i, r in enumerate(refs) if r == 0}

    @invariant()
    def kv_and_prefix_cache_are_consistent(self):
        bm = self.bm
        if bm is None:
            return
        bs = bm.block_size
        for seq in self.live.values():
            for p in range(seq.num_computed_tokens):
                assert self.kv[seq.block_table[p // bs] * bs + p % bs] == tuple(seq.token_ids[: p + 1])
        for h, b in bm.cached_block_ids.items():
            block = bm.blocks[b]
            assert block.block_hash == h
            assert [self.kv[b * bs + o][-1] for o in range(bs)] == block.token_ids
        for block in bm.blocks:
            if block.block_hash is not None:
                assert bm.cached_block_ids[block.block_hash] == block.block_id


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def _full_prefill(bm: BlockManager, seq: Sequence, kv: dict) -> None:
    assert admit(bm, seq, len(seq.token_ids), kv)


def test_freed_blocks_are_revived_until_reused():
    bm, kv = BlockManager(8, 4), {}
    a = make_seq(0, list(range(13)))  # 3 full blocks + 1 token
    _full_prefill(bm, a, kv)
    prefix_blocks = a.block_table[:3]
    bm.free(a)
    assert bm.num_free_blocks == 8
    b = make_seq(1, [*range(12), 99, 98])
    _full_prefill(bm, b, kv)
    assert b.block_table[:3] == prefix_blocks and b.num_computed_tokens == 14
    assert (bm.num_prefix_queried_tokens, bm.num_prefix_hit_tokens) == (13 + 14, 12)
    assert bm.num_used_blocks == 4
    bm.free(b)
    # Least recently freed first: a's tail block, then b's blocks tail first; the shared
    # prefix goes last. Taking 6 fresh blocks reuses only the last prefix block.
    c = make_seq(2, [50] * 24)
    _full_prefill(bm, c, kv)
    assert set(c.block_table) & set(prefix_blocks) == set(prefix_blocks[2:])
    d = make_seq(3, list(range(13)))
    assert bm.find_cached_blocks(d) == prefix_blocks[:2]


def test_last_prompt_token_is_always_computed():
    bm, kv = BlockManager(8, 4), {}
    _full_prefill(bm, make_seq(0, list(range(8))), kv)
    same = make_seq(1, list(range(8)))
    assert len(bm.find_cached_blocks(same)) == 1
    _full_prefill(bm, same, kv)
    assert bm.num_prefix_hit_tokens == 4


def test_no_hits_when_prefix_caching_is_off():
    bm, kv = BlockManager(8, 4, enable_prefix_caching=False), {}
    a = make_seq(0, list(range(13)))
    _full_prefill(bm, a, kv)
    bm.free(a)
    assert bm.find_cached_blocks(make_seq(1, list(range(13)))) == []
    assert not bm.cached_block_ids and bm.num_prefix_queried_tokens == 0


def test_shared_blocks_are_freed_only_by_their_last_owner():
    bm, kv = BlockManager(8, 2), {}
    a = make_seq(0, [1, 2, 3, 4, 5])
    _full_prefill(bm, a, kv)
    b = make_seq(1, [1, 2, 3, 4, 6])
    _full_prefill(bm, b, kv)
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert bm.num_used_blocks == 3
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_block_hash_is_stable_across_processes():
    tokens = [0, 1, 511, 2**31 + 5, 7]
    here = hash_block_tokens(hash_block_tokens(bytes(16), tokens[:2]), tokens[2:]).hex()
    code = (
        "from scheduler_service.block_manager import hash_block_tokens as h;"
        f"t={tokens!r};print(h(h(bytes(16), t[:2]), t[2:]).hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    there = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert here == there
    assert hash_block_tokens(bytes(16), [1, 2]) != hash_block_tokens(bytes(16), [2, 1])


@pytest.mark.parametrize("collision", ["constant_hash", "planted_entry"])
def test_hash_collision_is_not_a_hit(monkeypatch, collision):
    """A hit is confirmed by the block's tokens: a block whose hash matches but whose tokens
    differ is never handed out, and the hit counter does not count it."""
    if collision == "constant_hash":
        monkeypatch.setattr(block_manager, "hash_block_tokens", lambda parent, tokens: b"x" * 16)
    bm, kv = BlockManager(8, 4), {}
    a = make_seq(0, [1, 2, 3, 4, 5])
    _full_prefill(bm, a, kv)
    (cached,) = bm.cached_block_ids.values()
    other = make_seq(1, [9, 8, 7, 6, 5])
    if collision == "planted_entry":
        # The other prompt's first-block hash now points at a's block (tokens 1 2 3 4).
        bm.cached_block_ids[bm.block_hash(other, 0)] = cached
    assert bm.block_hash(other, 0) in bm.cached_block_ids  # the hashes do collide
    assert bm.find_cached_blocks(other) == []
    _full_prefill(bm, other, kv)  # admit() also checks every slot of a hit holds the right KV
    assert other.block_table[0] != cached
    assert bm.num_prefix_hit_tokens == 0
    # The same tokens still hit: the comparison rejects only real mismatches.
    same = make_seq(2, [1, 2, 3, 4, 6])
    assert bm.find_cached_blocks(same) == [cached]
    _full_prefill(bm, same, kv)
    assert bm.num_prefix_hit_tokens == 4
