"""Random interleavings of start / grow / fork / free / swap against the block manager.

Besides ``check_invariants()`` after every rule, a simulated KV store follows the copies the block
manager asks for, and every sequence must read back exactly its own tokens through its table:
a wrong prefix hit, a missed copy-on-write or a bad swap mapping shows up as wrong content.
"""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.worker.core.kv_cache.block_manager import BlockManager
from tests.conftest import examples

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=12)  # tiny alphabet: many prefix hits


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 3, 4]), gpu=st.integers(4, 24), cpu=st.integers(0, 12))
    def setup(self, block_size, gpu, cpu):
        self.bm = BlockManager(gpu, block_size, cpu, enable_prefix_caching=True)
        self.tokens: dict[int, list[int]] = {}
        self.kv: dict[tuple[str, int], list] = {}
        self.next_id = 0

    # -------------------------------------------------------------- simulated KV bytes
    def _copy(self, src_dev, dst_dev, pairs):
        for src, dst in pairs:
            self.kv[(dst_dev, dst)] = list(self.kv.get((src_dev, src), [None] * self.bm.block_size))

    def _write(self, seq_id, start):
        bs, table = self.bm.block_size, self.bm.block_table(seq_id)
        for pos in range(start, len(self.tokens[seq_id])):
            cell = self.kv.setdefault(("gpu", table[pos // bs]), [None] * bs)
            cell[pos % bs] = self.tokens[seq_id][pos]

    def _on_gpu(self):
        return [s for s in self.tokens if not self.bm.is_swapped(s)]

    def _grow(self, seq_id, new_tokens):
        start = len(self.tokens[seq_id])
        if self.bm.cost_to_grow([(seq_id, len(new_tokens))]) > self.bm.num_free_blocks:
            return
        self._copy("gpu", "gpu", self.bm.grow(seq_id, len(new_tokens)))
        self.tokens[seq_id] += new_tokens
        self._write(seq_id, start)
        self.bm.register_full_blocks(seq_id, self.tokens[seq_id], len(self.tokens[seq_id]))

    # -------------------------------------------------------------- rules
    @rule(tokens=TOKENS)
    def start(self, tokens):
        hit = self.bm.match_prefix(tokens)
        need = hit.num_reclaimed + self.bm.blocks_for(len(tokens)) - len(hit.blocks)
        if need > self.bm.num_free_blocks:
            return
        seq_id, self.next_id = self.next_id, self.next_id + 1
        cached = self.bm.start(seq_id, hit)
        assert cached == len(hit.blocks) * self.bm.block_size < len(tokens)
        self.tokens[seq_id] = tokens[:cached]
        self._grow(seq_id, tokens[cached:])

    @precondition(lambda self: self._on_gpu())
    @rule(data=st.data(), new=TOKENS)
    def grow(self, data, new):
        self._grow(data.draw(st.sampled_from(self._on_gpu())), new[:3])

    @precondition(lambda self: self._on_gpu())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._on_gpu()))
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        del self.tokens[seq_id]

    @precondition(lambda self: self._on_gpu())
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(self._on_gpu()))
        if self.bm.swap_out_cost([seq_id]) <= self.bm.cpu.num_free:
            self._copy("gpu", "cpu", self.bm.swap_out([seq_id]))

    @precondition(lambda self: any(self.bm.is_swapped(s) for s in self.tokens))
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from([s for s in self.tokens if self.bm.is_swapped(s)]))
        if self.bm.swap_in_cost([seq_id]) <= self.bm.num_free_blocks:
            self._copy("cpu", "gpu", self.bm.swap_in([seq_id]))

    # -------------------------------------------------------------- checks
    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        bs = self.bm.block_size
        for seq_id in self._on_gpu():
            table = self.bm.block_table(seq_id)
            assert self.bm.num_slots(seq_id) == len(self.tokens[seq_id])
            read = [self.kv[("gpu", table[p // bs])][p % bs] for p in range(len(self.tokens[seq_id]))]
            assert read == self.tokens[seq_id], f"seq {seq_id} reads {read}, wrote {self.tokens[seq_id]}"
        # usage() counts from table ends; here from every written slot of every block
        written = {}
        for seq_id in self._on_gpu():
            for p in range(len(self.tokens[seq_id])):
                block = self.bm.block_table(seq_id)[p // bs]
                written[block] = max(written.get(block, 0), p % bs + 1)
        usage = self.bm.usage()
        assert usage.tokens_held == sum(written.values())
        assert usage.logical == sum(len(self.bm.block_table(s)) for s in self._on_gpu())

    def teardown(self):
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.gpu.num_blocks
        assert self.bm.cpu.num_free == self.bm.cpu.num_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=examples(400), stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
