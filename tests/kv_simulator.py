"""A stand-in model runner for scheduler tests: it stores token ids as "KV" in paged slots.

It executes a StepPlan the way the real runner must (the tiers' spills and demotions, swap out,
the tiers' promotions and loads, swap in, copy-on-write copies, write the step's tokens into their
slots) and "samples" the next token as a hash of the context
it reads back through the block table. A wrong table, slot, copy or swap therefore changes the
output, which ``reference_output`` computes without any paging. With lanes (``lane_windows``, full
lanes first) every lane's blocks are written, and a sliding lane's window must read back exactly
what the first lane holds at those positions.
"""

from __future__ import annotations

from array import array

from pagedserve.worker.core.kv_cache.disk_tier import DiskTier
from pagedserve.worker.core.scheduling.plan import SampledToken, StepPlan, StepResult

VOCAB = 97


def next_token(context: list[int], salt: int = 0) -> int:
    h = 7 + salt * 1_000_003
    for t in context:
        h = (h * 31 + t + 1) % 1_000_000_007
    return h % VOCAB


def reference_output(prompt: list[int], index: int, max_tokens: int, eos: int | None, min_tokens: int = 0) -> list[int]:
    """What sequence ``index`` of a request must generate, computed without the engine."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        out.append(next_token(tokens, salt=index if not out else 0))
        tokens.append(out[-1])
        if len(out) >= min_tokens and eos is not None and out[-1] == eos:
            return out
        if len(out) >= max_tokens:
            return out


def block_payload(tokens: list[int | None]) -> bytes:
    """A simulated block as the bytes a disk tier stores (an unwritten slot as -1)."""
    return array("q", [-1 if t is None else t for t in tokens]).tobytes()


class KVSimulator:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, num_host_slots: int = 0,
                 disk: DiskTier | None = None, lane_windows: tuple[int, ...] = (0,)) -> None:
        if len(lane_windows) > 1 and lane_windows[0]:
            raise ValueError("lanes are simulated with a full first lane")
        self.block_size, self.lane_windows = block_size, lane_windows
        self.gpu = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.host = [[None] * block_size for _ in range(num_host_slots)]
        self.disk = disk
        self.tables: dict[int, list[list[int]]] = {}  # seq id -> its tables, one per lane

    def execute(self, plan: StepPlan) -> StepResult:
        tier = plan.tier  # in the runner's order (worker/runner/model_runner.py: apply_block_moves)
        for source, index, block_hash, key in tier.spills:
            self.disk.write(block_hash, key, block_payload((self.host if source == "host" else self.gpu)[index]))
        for block, slot in tier.demotions:
            self.host[slot] = list(self.gpu[block])
        for src, dst in plan.swap_out:
            self.cpu[dst] = list(self.gpu[src])
        for slot, block in tier.promotions:
            self.gpu[block] = list(self.host[slot])
        for payload, block in tier.loads:
            self.gpu[block] = [None if t == -1 else t for t in array("q", payload)]
        for src, dst in plan.swap_in:
            self.gpu[dst] = list(self.cpu[src])
        for src, dst in plan.copies:
            self.gpu[dst] = list(self.gpu[src])
        bs = self.block_size
        for item in plan.seqs:  # as the runner, it keeps each table and takes each step's changes
            kept = self.tables.get(item.seq_id, [[] for _ in self.lane_windows])
            self.tables[item.seq_id] = [item.kept_table(table, lane) for lane, table in enumerate(kept)]
            for table in self.tables[item.seq_id]:
                for token, slot in zip(item.token_ids, item.slot_mapping(bs, table)):
                    self.gpu[slot // bs][slot % bs] = token
        samples = {}
        for item in plan.seqs:
            if item.num_samples:
                context = self._read(item.seq_id, item.context_len)
                # Forks draw their first token with salt = output index; everything else salt 0.
                samples[item.seq_id] = tuple(SampledToken(next_token(context, salt=k)) for k in range(item.num_samples))
        return StepResult(samples)


    def _read(self, seq_id: int, context_len: int) -> list[int]:
        """The context as the first lane holds it; each sliding lane's window must agree."""
        tables, bs = self.tables[seq_id], self.block_size
        context = [self.gpu[tables[0][p // bs]][p % bs] for p in range(context_len)]
        assert None not in context, f"seq {seq_id} reads unwritten KV"
        for lane, window in enumerate(self.lane_windows[1:], 1):
            first = max(0, context_len - window)
            seen = [self.gpu[tables[lane][p // bs]][p % bs] for p in range(first, context_len)]
            assert seen == context[first:], f"seq {seq_id}: lane {lane} reads other KV than the first lane"
        return context
