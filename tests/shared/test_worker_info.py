"""WorkerInfo on the wire: it round-trips, and anything else is a ProtocolError naming the field."""

import pytest

from pagedserve.shared.protocol import ProtocolError, pack
from pagedserve.shared.worker_info import WORKER_INFO_VERSION, WorkerInfo

INFO = WorkerInfo("w0", "demo", max_model_len=2048, vocab_size=512, block_size=16, rope_switch=0, max_num_seqs=8,
                  kv_cache_dtype="int8", kv_bytes_per_token=7920, running=3, waiting=1, draining=True,
                  adapters=("chat", "sql"))


def test_it_round_trips():
    assert WorkerInfo.decode(INFO.encode()) == INFO


def test_load_figures_and_the_cache_format_may_be_left_out():
    """An older worker says nothing of its cache: a model-dtype one."""
    wire = {"v": WORKER_INFO_VERSION, "name": "w0", "model": "demo", "max_model_len": 8, "vocab_size": 4,
            "block_size": 16, "rope_switch": 0, "max_num_seqs": 1}
    assert WorkerInfo.decode(pack(wire)) == WorkerInfo("w0", "demo", 8, 4, 16, 0, 1)


@pytest.mark.parametrize("change, field", [
    ({"v": 99}, "v"), ({"max_model_len": "2048"}, "max_model_len"), ({"block_size": None}, "block_size"),
    ({"running": -1}, "running"), ({"draining": 1}, "draining"), ({"vocab_size": True}, "vocab_size"),
    ({"kv_cache_dtype": 8}, "kv_cache_dtype"), ({"adapters": "sql"}, "adapters"), ({"adapters": ["sql", 3]}, "adapters"),
])
def test_a_malformed_info_is_refused(change, field):
    wire = {"v": WORKER_INFO_VERSION, **INFO.__dict__, **change}
    with pytest.raises(ProtocolError) as err:
        WorkerInfo.decode(pack(wire))
    assert err.value.field == field


def test_junk_is_refused():
    with pytest.raises(ProtocolError):
        WorkerInfo.decode(b"\xc1 not msgpack")
    with pytest.raises(ProtocolError):
        WorkerInfo.decode(pack([1, 2]))
