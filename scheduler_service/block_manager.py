"""KV-cache block allocation: reference counts, the free list and the prefix cache.

The block manager owns block ids only; the KV tensors live in the executor. A sequence's
`block_table` maps its token positions to blocks: position p lives in
`block_table[p // block_size]`.

Prefix caching: a full block whose tokens are all computed is registered under a hash
chained over the previous block's hash and its own token ids, so equal hashes mean equal
prefixes. A hit is confirmed by comparing the token ids stored with the block. Freed blocks
keep their hash and token ids and can be revived until the free list hands them out again;
the free list gives out the least recently freed block first.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence as Seq

from scheduler_service.sequence import Sequence

_ROOT_HASH = bytes(16)


@functools.cache
def _tokens_struct(num_tokens: int) -> struct.Struct:
    """The packing of a block's token ids (one per block size: building the format each time was
    a fifth of a hash)."""
    return struct.Struct(f"<{num_tokens}q")


def hash_block_tokens(parent_hash: bytes, token_ids: Seq[int]) -> bytes:
    """Stable across processes and platforms (unlike Python's `hash`)."""
    data = parent_hash + _tokens_struct(len(token_ids)).pack(*token_ids)
    return hashlib.blake2b(data, digest_size=16).digest()


# What append_slots returns when no block is added (never mutated).
_NO_BLOCKS: list[int] = []


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        # Set only while the prefix cache maps block_hash to this block.
        self.block_hash: bytes | None = None
        self.token_ids: list[int] | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first (an ordered set: O(1) revive).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_ids: dict[bytes, int] = {}
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0

    # -- accounting ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add to seq.block_table to compute num_new_tokens more tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return -(-total // self.block_size) - len(seq.block_table)

    # -- prefix cache ---------------------------------------------------------------------

    def block_hash(self, seq: Sequence, index: int) -> bytes:
        """The chained hash of full block `index` of seq.token_ids (memoised on the sequence)."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[i - 1] if i else _ROOT_HASH
            hashes.append(hash_block_tokens(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes[index]

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """The longest run of cached blocks holding seq's leading tokens. Changes nothing."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        # The last token is always computed: the executor needs its logits to sample.
        max_blocks = (len(seq.token_ids) - 1) // bs
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self.cached_block_ids.get(self.block_hash(seq, i))
            if block_id is None or self.blocks[block_id].token_ids != seq.token_ids[i * bs : (i + 1) * bs]:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> list[int]:
        """Register seq's full blocks whose tokens are all known and whose KV is written by the
        first num_tokens positions (default seq.num_kv_written: by steps whose results are back).
        Returns the blocks newly registered."""
        if not self.enable_prefix_caching:
            return _NO_BLOCKS
        bs = self.block_size
        if num_tokens is None:
            num_tokens = seq.num_kv_written
        num_full = min(num_tokens, len(seq.token_ids)) // bs
        registered = []
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            h = self.block_hash(seq, i)
            # The same content may already be cached under another block (two sequences
            # prefilled it at once): keep the first, this one stays private.
            if block.block_hash is None and h not in self.cached_block_ids:
                block.block_hash = h
                block.token_ids = seq.token_ids[i * bs : (i + 1) * bs]
                self.cached_block_ids[h] = block.block_id
                registered.append(block.block_id)
        if num_full > seq.num_registered_blocks:
            seq.num_registered_blocks = num_full
        return registered

    def uncache(self, block_ids: Seq[int]) -> None:
        """Take blocks out of the prefix cache (registered for a plan that never ran)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            h = block.block_hash
            if h is not None and self.cached_block_ids.get(h) == block_id:
                del self.cached_block_ids[h]
                block.block_hash = None
                block.token_ids = None

    # -- allocation -----------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        """Whether seq (holding no blocks) can take cached_blocks plus room for num_new_tokens."""
        num_revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        total = len(cached_blocks) * self.block_size + num_new_tokens
        num_fresh = -(-total // self.block_size) - len(cached_blocks)
        return num_revived + num_fresh <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> None:
        """Give seq its first blocks: the cached prefix (shared) plus fresh ones for
        num_new_tokens tokens after it. The caller sets num_computed_tokens to the hit."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            raise RuntimeError(f"not enough free blocks for sequence {seq.seq_id}")
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        total = len(cached_blocks) * self.block_size + num_new_tokens
        num_fresh = -(-total // self.block_size) - len(cached_blocks)
        seq.block_table = [*cached_blocks, *self._take(num_fresh)]
        seq.num_registered_blocks = len(cached_blocks)
        if self.enable_prefix_caching:
            self.num_prefix_queried_tokens += len(seq.token_ids)
            self.num_prefix_hit_tokens += len(cached_blocks) * self.block_size

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the free blocks can hold num_new_tokens more computed tokens of seq."""
        total = seq.num_computed_tokens + num_new_tokens
        room = len(seq.block_table) * self.block_size
        return total <= room or -(-(total - room) // self.block_size) <= len(self.free_block_ids)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grow seq.block_table to hold num_new_tokens more computed tokens; returns the new ids
        (none while the last block has room)."""
        total = seq.num_computed_tokens + num_new_tokens
        if total <= len(seq.block_table) * self.block_size:
            return _NO_BLOCKS
        needed = -(-total // self.block_size) - len(seq.block_table)
        if needed > len(self.free_block_ids):
            raise RuntimeError(f"not enough free blocks for sequence {seq.seq_id}")
        new = self._take(needed)
        seq.block_table.extend(new)
        return new

    def release_tail(self, seq: Sequence, num_blocks: int) -> None:
        """Give back the last num_blocks of seq's table, appended by a plan that never ran."""
        for _ in range(num_blocks):
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block.block_id] = None
        seq.num_registered_blocks = min(seq.num_registered_blocks, len(seq.block_table))

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail blocks are freed first so they are reused before the
        shared prefix blocks that precede them."""
        blocks = self.blocks
        free_ids = self.free_block_ids
        for block_id in reversed(seq.block_table):
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                free_ids[block_id] = None
            elif block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed twice")
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                # Reused for other content: the old prefix is no longer cached.
                del self.cached_block_ids[block.block_hash]
                block.block_hash = None
                block.token_ids = None
            block.ref_count = 1
            out.append(block_id)
        return out
