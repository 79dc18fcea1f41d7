"""The pool of KV-cache blocks: ref counts, a free queue in eviction order, prefix caching.

Pure Python over integers: it decides which physical block holds which tokens; the
model runner owns the memory behind the block ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from paged_llm.engine.sequence import Sequence

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: list[int]) -> BlockHash:
    """Chained hash of one full block: it names the block's tokens and every token before.

    SHA-256 makes a collision (two different prefixes sharing a cached block) practically
    impossible, so a hash hit can be trusted without comparing tokens.
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_count: int = 0
    # Set while the block is registered in the prefix cache; kept after the block is
    # freed, until the block is reused for other tokens.
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks; the head is reused (evicted) first.

    Removal from the middle is O(1), which a prefix-cache hit on a freed block needs.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        assert prev_block is not None and next_block is not None, "block is not free"
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self._len -= 1

    def salvage_order(self) -> list[KVCacheBlock]:
        """The blocks linked from the head, each once, even where links are half-written.

        An interrupted `append` or `remove` can leave a link missing or stale; the walk
        stops at the tail, a missing link or a block already seen.
        """
        order: dict[int, KVCacheBlock] = {}
        node = self._head.next_free
        while node is not None and node is not self._tail and node.block_id not in order:
            order[node.block_id] = node
            node = node.next_free
        return list(order.values())


class BlockManager:
    """Allocates blocks to sequences and shares full blocks between identical prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # seq_id -> how many leading blocks of its table were offered to the prefix cache.
        self._num_registered_blocks: dict[int, int] = {}
        # (source, destination) blocks that forks copy; see `fork`.
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def _update_block_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        hashes = seq.block_hashes
        size = self.block_size
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else seq.request.block_hash_seed
            hashes.append(hash_block_tokens(parent, seq.token_ids[i * size : (i + 1) * size]))

    def find_cached_prefix(
        self, seq: Sequence, max_tokens: int | None = None
    ) -> list[KVCacheBlock]:
        """The longest run of cached blocks that starts the sequence, within its first
        ``max_tokens`` tokens where given.

        At least one token is left out so there are logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if max_tokens is not None:
            max_blocks = min(max_blocks, max_tokens // self.block_size)
        self._update_block_hashes(seq, max_blocks)
        hits: list[KVCacheBlock] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_prefix: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens after its computed ones.

        ``cached_prefix`` (from `find_cached_prefix`, for a sequence with no blocks yet)
        is shared rather than allocated. Returns False, changing nothing, when the free
        blocks do not suffice.
        """
        cached_prefix = cached_prefix or []
        admitted = not seq.block_table
        num_tokens = seq.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        num_new_blocks = (
            self.num_blocks_needed(num_tokens) - len(seq.block_table) - len(cached_prefix)
        )
        # A cached block nobody holds sits in the free queue: taking it uses up a free block.
        num_revived = sum(1 for block in cached_prefix if block.ref_count == 0)
        if num_new_blocks + num_revived > self.num_free_blocks:
            return False
        for block in cached_prefix:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        if cached_prefix:
            self._num_registered_blocks[seq.seq_id] = len(cached_prefix)
        for _ in range(num_new_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            seq.block_table.append(block.block_id)
        if admitted and self.enable_prefix_caching:
            self.prefix_cache_queried_tokens += seq.num_tokens
            self.prefix_cache_hit_tokens += len(cached_prefix) * self.block_size
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly filled, computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_registered_blocks.get(seq.seq_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(seq, num_full)
        for i in range(start, num_full):
            block_hash = seq.block_hashes[i]
            if block_hash not in self.cached_blocks:
                block = self.blocks[seq.block_table[i]]
                block.block_hash = block_hash
                self.cached_blocks[block_hash] = block
        self._num_registered_blocks[seq.seq_id] = num_full

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Start a child whose tokens but its last are the parent's computed ones (an
        ``n > 1`` sibling: the same prompt; a beam: the parent's tokens and one more) on
        the parent's cache; return the tokens it starts with computed.

        It shares the parent's full blocks among those tokens. The parent's partially
        filled block after them is copied into a free block of the child's own (the copy
        waits in `pending_copies` for the next forward); with no free block, the child
        recomputes those tokens instead. Its last token it always computes, for its logits.
        """
        num_tokens = min(parent.num_computed_tokens, child.num_tokens - 1)
        num_shared = num_tokens // self.block_size
        for block_id in parent.block_table[:num_shared]:
            self.blocks[block_id].ref_count += 1
        child.block_table = parent.block_table[:num_shared]
        # Same tokens, same chain: the child need not hash its prompt again.
        child.block_hashes = parent.block_hashes[:num_shared]
        self._num_registered_blocks[child.seq_id] = num_shared
        if num_tokens % self.block_size == 0 or self.num_free_blocks == 0:
            return num_shared * self.block_size
        block = self.free_queue.popleft()
        self._evict(block)
        block.ref_count = 1
        child.block_table.append(block.block_id)
        self.pending_copies.append((parent.block_table[num_shared], block.block_id))
        return num_tokens

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies that forks asked for since the last call:
        the next forward must make them before it writes to the cache."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; cached ones stay findable until reused."""
        # NOTE: tail blocks go into the free queue first so they are evicted first: a
        # prefix is only useful with the blocks before it.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)
        seq.block_table.clear()
        self._num_registered_blocks.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so later prompts compute their KV anew; False (and
        nothing forgotten) while a sequence holds blocks, whose hashes it still uses."""
        if self.num_free_blocks < self.num_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def reset(self) -> None:
        """Return every block to the pool, once no sequence holds any (`Scheduler.abort_all`).

        The prefix cache survives: cached blocks stay findable until reused.
        """
        # NOTE: this is the repair path after an interrupt (a KeyboardInterrupt in a
        # notebook) between any two lines of a mutation: `allocate_slots`, `fork`,
        # `free`, `cache_full_blocks`, `_evict` or the free queue's own updates. Those
        # keep no invariant mid-way, so this trusts none of the derived state and
        # rebuilds it from the blocks alone: every ref count is 0 (nobody holds a
        # block), the free queue holds every block once (its old order where the links
        # from its head still hold, then the blocks that were in use), and a hash stays
        # cached only where the block and the map agree on it. Idempotent, so an
        # interrupt inside it is repaired by calling it again.
        order = self.free_queue.salvage_order()
        salvaged = {block.block_id for block in order}
        order += [block for block in self.blocks if block.block_id not in salvaged]
        for block in self.blocks:
            block.ref_count = 0
            block.prev_free = block.next_free = None
            if (
                block.block_hash is not None
                and self.cached_blocks.get(block.block_hash) is not block
            ):
                block.block_hash = None
        self.cached_blocks = {h: b for h, b in self.cached_blocks.items() if b.block_hash == h}
        self.free_queue = FreeBlockQueue(order)
        self._num_registered_blocks.clear()
        self.pending_copies = []
