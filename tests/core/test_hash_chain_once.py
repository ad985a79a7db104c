"""A request's block-hash chain is computed once and kept on it: a prompt that waits for blocks
step after step is not hashed again each step, nor when its blocks are registered after prefill."""

from collections import Counter

import pagedserve.shared.block_hash as block_hash_module
import pagedserve.worker.core.kv_cache.block_manager as block_manager_module
from tests.core.test_scheduler import make, params, step


def test_a_waiting_prompt_is_hashed_once(monkeypatch):
    hashed = Counter()
    real = block_hash_module.block_hash

    def counting(parent, tokens, salt=None):
        hashed[tuple(tokens)] += 1
        return real(parent, tokens, salt)

    monkeypatch.setattr(block_hash_module, "block_hash", counting)  # prefix_hashes looks it up here
    monkeypatch.setattr(block_manager_module, "block_hash", counting)
    sched, sim = make(num_blocks=8, block_size=4)
    sched.add("a", list(range(100, 120)), params(max_tokens=3))  # 5 blocks, and a sixth as it decodes
    sched.add("b", list(range(13)), params(max_tokens=2))  # needs 4 blocks: waits until a is done
    waited = 0
    while sched.has_work:
        plan, _ = step(sched, sim)
        waited += "b" not in {s.request_id for s in plan.seqs}
    assert waited >= 3  # b's prefix was matched against the cache on each of these steps
    a_blocks = {tuple(range(100 + 4 * i, 104 + 4 * i)) for i in range(5)}
    b_blocks = {tuple(range(4 * i, 4 * i + 4)) for i in range(3)}
    assert set(hashed) == a_blocks | b_blocks and set(hashed.values()) == {1}, hashed
