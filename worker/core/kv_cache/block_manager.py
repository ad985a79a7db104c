"""Block tables over a GPU and a CPU pool: paging, copy-on-write forks, prefix reuse and swap.

Each sequence owns a block table (logical block i -> physical block) that covers exactly the
token slots it has been given (``num_slots``). A block is written only while its reference
count is 1; growing a sequence into a shared partial block first copies it (``(src, dst)``).

Prefix cache: a full block is keyed by ``block_hash(parent_hash, tokens, extra_key)``
(``shared/block_hash.py``: the same in every process, so the gateway can route on it), chained from
the first block, and verified against the stored key on a hit. Lookups cap the hit at
``(len(prompt) - 1) // block_size`` blocks so that a fully cached prompt still recomputes its
last token (its logits are needed to sample).

Swap moves whole sequence groups: blocks shared inside the group stay shared on the CPU side.
Swapped-in blocks come back unhashed; their content is valid but they are not re-published.

Lanes (``kv_layout.py``): the layers are grouped by their attention and cut into lanes of equal
size; a sequence has one table per lane, every lane's blocks from the one pool. Growth, forks,
copy-on-write, swap, the prefix cache and the tiers under it act on every lane (a lane's copy of a cached block has its
own hash, ``lane_hits.py``, and only the first lane's is announced to KV events); one lane is the
model without groups.

Sliding windows: in a lane whose layers attend only to their last W positions, a block that holds
only positions no future query can see is released (``release_outside_windows``): its table entry
becomes ``NO_BLOCK`` and its reference goes back to the pool (to the prefix cache, evictable, when
it is published there). Released entries are always a leading run of the lane's table; the kernels
never read them (they start at the window). A full lane keeps every block.

The runner keeps every sequence's tables between steps (``worker/runner/attention/kept_tables.py``),
so a step hands over only what changed: ``table_change`` gives the entries from the first one the
runner does not hold as they are now (appended blocks, a copy-on-write's new block, all of a
started, forked or swapped-in table; a rewind shortens). A release changes nothing the runner reads.

Pure Python, no torch.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence

from pagedserve.shared.block_hash import block_hash
from pagedserve.worker.core.kv_cache.block_pool import BLOCK_SIZE, BlockPool
from pagedserve.worker.core.kv_cache.block_tables import BELOW, NO_BLOCK, count_unique, held_blocks, move_tables
from pagedserve.worker.core.kv_cache.lane_hits import is_lane_hash, lane_hash, lane_key
from pagedserve.worker.core.kv_cache.kv_events import KvEvents
from pagedserve.worker.core.kv_cache.prefix_hit import NO_HIT, PrefixHit, find_hit
from pagedserve.worker.core.kv_cache.table_reports import BlockUsage, TableState, check_tables, usage_of
from pagedserve.worker.core.kv_cache.tiers import NO_TIER_MOVES, KvTiers, TierMoves



class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        tiers: KvTiers | None = None,
        lane_windows: Sequence[int] = (0,),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not lane_windows or any(w < 0 for w in lane_windows):
            raise ValueError(f"lane_windows must be one window (0: full) per lane, got {lane_windows}")
        self.block_size = block_size
        self.lane_windows = tuple(lane_windows)
        self.num_lanes = len(self.lane_windows)
        self.enable_prefix_caching = enable_prefix_caching
        self.gpu = BlockPool(num_blocks, name="gpu")
        self.cpu = BlockPool(num_cpu_blocks, name="cpu")
        self.tiers = tiers if enable_prefix_caching else None
        if self.tiers is not None:
            self.gpu.on_evict = self.tiers.demote
            self.tiers.on_device = self.gpu.holds
        self.state = TableState()  # every sequence's tables and what goes with them, under short names below
        self._tables, self._cpu_tables, self._num_slots = self.state.tables, self.state.cpu_tables, self.state.num_slots
        self._hashes, self._released, self._kept = self.state.hashes, self.state.released, self.state.kept

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    def block_table(self, seq_id: int, lane: int = 0) -> tuple[int, ...]:
        return tuple(self._tables[seq_id][lane])

    def lane_tables(self, seq_id: int) -> tuple[tuple[int, ...], ...]:
        """The seq's tables of the lanes after the first (empty with one lane)."""
        return tuple(tuple(table) for table in self._tables[seq_id][1:])

    def table_change(self, seq_id: int) -> tuple[int, tuple[tuple[int, ...], ...]]:
        """``(start, tails)``: each lane's entries from ``start`` on, which the runner does not hold as
        they are (it keeps the ones before); from now on it holds them all."""
        lanes, start = self._tables[seq_id], self._kept[seq_id]
        self._kept[seq_id] = len(lanes[0])
        return start, tuple(tuple(table[start:]) for table in lanes)

    def _changed_from(self, seq_id: int, index: int) -> None:
        self._kept[seq_id] = min(self._kept[seq_id], index)

    def tables_of(self, seq_id: int) -> tuple[str, tuple[tuple[int, ...], ...]] | None:
        """``("gpu" | "cpu", each lane's table)`` of a sequence that holds blocks, else None (for the
        dashboard)."""
        for device, tables in (("gpu", self._tables), ("cpu", self._cpu_tables)):
            if seq_id in tables:
                return device, tuple(tuple(table) for table in tables[seq_id])
        return None

    def num_held(self, seq_id: int) -> int:
        """Device blocks the seq's tables hold, every lane's (a shared one counted in each)."""
        return sum(len(table) - released for table, released in zip(self._tables[seq_id], self._released[seq_id]))

    def num_slots(self, seq_id: int) -> int:
        return self._num_slots[seq_id]

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._tables or seq_id in self._cpu_tables

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def block_key(self, parent_hash: int | None, tokens: Sequence[int], extra_key: Hashable) -> tuple:
        return (parent_hash, tuple(tokens), extra_key)

    def match_prefix(self, token_ids: Sequence[int], extra_key: Hashable = None, known: Sequence[int] = ()) -> PrefixHit:
        """The longest run of cached full blocks at the start of ``token_ids`` (last token excluded)
        that every lane can start from, each lane's copy on the device or below it
        (``prefix_hit.py``). ``known``: the leading blocks' hashes where the caller keeps them (a
        request's prompt chain)."""
        if not self.enable_prefix_caching:
            return NO_HIT
        return find_hit(self.gpu, self.tiers, self.lane_windows, self.block_size,
                        lambda: self._prompt_chain(token_ids, extra_key, known))

    def _prompt_chain(self, token_ids: Sequence[int], extra_key: Hashable, known: Sequence[int]):
        """``(hash, key)`` of each full block a prefix hit can cover, hashed only past ``known``."""
        parent: int | None = None
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            key = self.block_key(parent, token_ids[i * bs : (i + 1) * bs], extra_key)
            parent = known[i] if i < len(known) else block_hash(*key)
            yield parent, key

    def hold(self, hits: Sequence[PrefixHit]) -> None:
        """These hits start this step: the tier slots they read are kept until the copies ran."""
        if self.tiers is not None:
            self.tiers.hold([below for hit in hits for below in hit.lower])

    def promote(self, seq_id: int, hit: PrefixHit) -> int:
        """Give a started sequence the hit's blocks from below the device, each copied up into a
        device block this step (a sibling that promoted the same block first is shared). Returns
        the tokens now computed."""
        below = iter(hit.lower)
        for table in self._tables[seq_id]:
            for i in [i for i, b in enumerate(table) if b == BELOW]:
                found = next(below)
                block = self.gpu.lookup(found.block_hash, found.key)
                if block is not None:
                    self.gpu.incref(block)
                else:
                    block = self.gpu.allocate()
                    self.gpu.register(block, found.block_hash, found.key, announce=not is_lane_hash(found.block_hash))
                    self.tiers.promote(found, block)
                table[i] = block
        return self._num_slots[seq_id]

    def record_kv_events(self, events: KvEvents | None) -> None:
        """Tell ``events`` each hash the prefix cache publishes, lowers to a tier or drops (None: stop)."""
        self.gpu.events = events
        if self.tiers is not None:
            self.tiers.events = events

    def lowered_hashes(self) -> list[int]:
        """The hashes only the tiers below the device hold."""
        return self.tiers.lowered_hashes() if self.tiers is not None else []

    def take_tier_moves(self) -> TierMoves:
        """The copies this step's decisions need between the device and the tiers below it."""
        return self.tiers.take_moves() if self.tiers is not None else NO_TIER_MOVES

    def register_full_blocks(
        self, seq_id: int, token_ids: Sequence[int], num_computed: int, extra_key: Hashable = None,
        known: Sequence[int] = (),
    ) -> None:
        """Publish the seq's blocks that are full and whose KV has been computed (``known``: as in
        ``match_prefix``)."""
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        chain, lanes, bs = self._hashes[seq_id], self._tables[seq_id], self.block_size
        for i in range(len(chain), min(num_computed // bs, len(lanes[0]))):
            key = self.block_key(chain[-1] if chain else None, token_ids[i * bs : (i + 1) * bs], extra_key)
            chain.append(known[i] if i < len(known) else block_hash(*key))
            for lane, table in enumerate(lanes):
                if table[i] != NO_BLOCK:
                    self.gpu.register(table[i], lane_hash(chain[-1], lane), lane_key(key, lane), announce=lane == 0)

    # ------------------------------------------------------------------ allocation
    def start(self, seq_id: int, hit: PrefixHit | None = None) -> int:
        """Create an empty table for a new sequence, taking the prefix-hit blocks. Returns the
        number of tokens already computed (the cached prefix)."""
        if self.has_seq(seq_id):
            raise ValueError(f"sequence {seq_id} already has blocks")
        hit = hit or NO_HIT
        for block in hit.held():
            self.gpu.incref(block)
        lanes = [list(table) for table in hit.tables] or [[] for _ in range(self.num_lanes)]
        self._tables[seq_id] = lanes  # its BELOW entries are filled by ``promote``
        self._hashes[seq_id] = list(hit.hashes)
        self._released[seq_id] = [sum(1 for b in table if b == NO_BLOCK) for table in lanes]
        self._kept[seq_id] = 0
        self._num_slots[seq_id] = hit.num_blocks * self.block_size
        return self._num_slots[seq_id]

    def start_cost(self, hit: PrefixHit, num_tokens: int) -> int:
        """Blocks a new sequence takes from the free ones to hold ``num_tokens`` (its hit's
        included) after starting from ``hit``: every lane's new blocks and the promoted ones."""
        kept = sum(1 for table in hit.tables for b in table if b != BELOW)
        return self.num_lanes * self.blocks_for(num_tokens) - kept

    def cost_to_grow(self, seq_ids_and_counts: Sequence[tuple[int, int]]) -> int:
        """Free GPU blocks needed to give each seq its extra slots, copy-on-write copies included.

        Exact for applying ``grow`` in the given order (a shared block copied by one seq has one
        reference fewer when the next seq looks at it). For swapped seqs it is the cost once they
        are swapped back in, on top of ``swap_in_cost``."""
        released: Counter[int] = Counter()
        needed = 0
        for seq_id, count in seq_ids_and_counts:
            if count <= 0:
                continue
            start = self._num_slots[seq_id]
            lanes, pool = (self._cpu_tables[seq_id], self.cpu) if self.is_swapped(seq_id) else (self._tables[seq_id], self.gpu)
            for table in lanes:
                if start % self.block_size:
                    last = table[start // self.block_size]
                    if pool.ref_count(last) - released[last] > 1:
                        needed += 1
                        released[last] += 1
                needed += self.blocks_for(start + count) - len(table)
        return needed

    def grow(self, seq_id: int, count: int) -> list[tuple[int, int]]:
        """Give the seq ``count`` more slots. Returns the copy-on-write copies ``(src, dst)``."""
        start = self._num_slots[seq_id]
        copies: list[tuple[int, int]] = []
        if count <= 0:
            return copies
        for table in self._tables[seq_id]:
            if start % self.block_size:
                index = start // self.block_size
                shared = table[index]
                if self.gpu.ref_count(shared) > 1:
                    self._changed_from(seq_id, index)
                    table[index] = self.gpu.allocate()
                    self.gpu.decref(shared)
                    copies.append((shared, table[index]))
            while len(table) < self.blocks_for(start + count):
                table.append(self.gpu.allocate())
        self._num_slots[seq_id] = start + count
        return copies

    def rewind(self, seq_id: int, num_slots: int) -> None:
        """Give back the seq's slots past ``num_slots`` (speculative drafts rejected); a block left
        without a slot goes back to the pool. Those slots were never published (not computed)."""
        if not 0 <= num_slots <= self._num_slots[seq_id]:
            raise ValueError(f"seq {seq_id}: cannot rewind {self._num_slots[seq_id]} slots to {num_slots}")
        for table, released in zip(self._tables[seq_id], self._released[seq_id]):
            if self.blocks_for(num_slots) < released:
                raise ValueError(f"seq {seq_id}: cannot rewind to {num_slots} slots, behind its released blocks")
            while len(table) > self.blocks_for(num_slots):
                self.gpu.decref(table.pop())
        self._changed_from(seq_id, self.blocks_for(num_slots))
        self._num_slots[seq_id] = num_slots

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (no copy until one of them writes)."""
        if self.has_seq(child_id):
            raise ValueError(f"sequence {child_id} already has blocks")
        lanes = self._tables[parent_id]
        for block in held_blocks(lanes):
            self.gpu.incref(block)
        self._tables[child_id] = [list(table) for table in lanes]
        self._hashes[child_id] = list(self._hashes[parent_id])
        self._num_slots[child_id] = self._num_slots[parent_id]
        self._released[child_id] = list(self._released[parent_id])
        self._kept[child_id] = 0

    def release_outside_windows(self, seq_id: int, next_position: int) -> int:
        """Release, in each sliding lane, the seq's blocks no query from ``next_position`` on will
        read (it sees its last W positions). Returns how many were released."""
        return sum(self.release_before(seq_id, next_position - window + 1, lane)
                   for lane, window in enumerate(self.lane_windows) if window)

    def release_before(self, seq_id: int, position: int, lane: int = 0) -> int:
        """Release the seq's GPU blocks in ``lane`` that hold only positions before ``position``
        (no query will read them again under a sliding window). Returns how many were released."""
        lanes = self._tables.get(seq_id)
        if lanes is None:
            return 0
        table, released = lanes[lane], self._released[seq_id]
        first, last = released[lane], min(max(position, 0) // self.block_size, len(table))
        for i in range(first, last):
            self.gpu.decref(table[i])
            table[i] = NO_BLOCK
        if last > first:
            released[lane] = last
        return max(0, last - first)

    def free(self, seq_id: int) -> None:
        """Release the seq's blocks on whichever device they are. Unknown ids are ignored."""
        for pool, tables in ((self.gpu, self._tables), (self.cpu, self._cpu_tables)):
            # Release from the end so the prefix's head blocks are the last to be evicted.
            for block in reversed(held_blocks(tables.pop(seq_id, []))):
                pool.decref(block)
        self._num_slots.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self._released.pop(seq_id, None)
        self._kept.pop(seq_id, None)

    # ------------------------------------------------------------------ swap
    def swap_out_cost(self, seq_ids: Sequence[int]) -> int:
        """CPU blocks needed to swap these seqs out (shared blocks counted once)."""
        return count_unique(self._tables, seq_ids)

    def swap_in_cost(self, seq_ids: Sequence[int]) -> int:
        """GPU blocks needed to swap these seqs back in."""
        return count_unique(self._cpu_tables, seq_ids)

    def is_swapped(self, seq_id: int) -> bool:
        return seq_id in self._cpu_tables

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move the seqs' blocks to the CPU pool. Returns ``(gpu, cpu)`` copies."""
        return move_tables(seq_ids, self._tables, self._cpu_tables, self.gpu, self.cpu)

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move the seqs' blocks back to the GPU pool. Returns ``(cpu, gpu)`` copies."""
        self._kept.update((seq_id, 0) for seq_id in seq_ids)
        return move_tables(seq_ids, self._cpu_tables, self._tables, self.cpu, self.gpu)

    # ------------------------------------------------------------------ reports and checks
    def usage(self) -> BlockUsage:
        """Counts of both pools (logs, metrics, the dashboard)."""
        return usage_of(self.state, self.gpu, self.cpu, self.block_size)

    def check_invariants(self) -> None:
        """Raise AssertionError if any table, refcount, free list or hash entry disagrees."""
        self.gpu.check_invariants(Counter(b for lanes in self._tables.values() for b in held_blocks(lanes)))
        self.cpu.check_invariants(Counter(b for lanes in self._cpu_tables.values() for b in held_blocks(lanes)))
        if self.tiers is not None:
            self.tiers.check_invariants()
        check_tables(self.state, self.lane_windows, self.block_size)
