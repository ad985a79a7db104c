"""``worker/serve/intake.py`` on its own: what a queue entry becomes (a request, or ``Rejected``
with the reason the dead-letter stream keeps) and whom a rejected entry's sender can be told by.
The worker service runs every entry through these (``tests/serve/test_worker_service.py`` and
``test_worker_poison.py`` show it end to end)."""

from __future__ import annotations

import msgpack
import pytest

from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import VERSION, ReplyTarget
from pagedserve.worker.serve.intake import Rejected, admit, salvage_reply

KEYS = Keys()
CHANNEL = KEYS.replies("client-1")


def entry(**fields) -> bytes:
    base = {"v": VERSION, "id": "r1", "model": "tiny", "prompt_token_ids": [5, 6], "reply": {"channel": CHANNEL}}
    return msgpack.packb({k: v for k, v in {**base, **fields}.items() if v is not ...}, use_bin_type=True)


def test_a_well_formed_entry_is_the_request_it_names():
    req = admit(entry(), "tiny", KEYS)
    assert (req.id, req.model, req.prompt_token_ids, req.reply) == ("r1", "tiny", [5, 6], ReplyTarget("channel", CHANNEL))
    results = KEYS.results("client-1")
    assert admit(entry(reply={"stream": results}), "tiny", KEYS).reply == ReplyTarget("stream", results)


@pytest.mark.parametrize("data, reason", [
    (None, "malformed msgpack"),
    (b"", "malformed msgpack"),
    (b"\xc1 not msgpack", "malformed msgpack"),
    (entry(v=99), "unsupported protocol version 99 (this worker speaks 1)"),
    (entry(params={"temperature": -1}), "temperature"),
    (entry(model="other"), "this worker serves 'tiny', not 'other'"),
    (entry(reply={"channel": "pagedserve:alive:x"}),
     "reply target channel 'pagedserve:alive:x' is outside pagedserve:replies:* (channels) and "
     "pagedserve:results:* (streams)"),
    (entry(reply={"stream": "elsewhere"}), "reply target stream 'elsewhere' is outside pagedserve:replies:*"),
])
def test_an_entry_that_cannot_run_is_rejected_with_its_reason(data, reason):
    with pytest.raises(Rejected) as err:
        admit(data, "tiny", KEYS)
    assert reason in str(err.value), str(err.value)


def test_whatever_the_decoder_did_not_foresee_is_still_the_entrys_fault(monkeypatch):
    from pagedserve.shared import protocol

    def explode(data):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(protocol.WireRequest, "decode", staticmethod(explode))
    with pytest.raises(Rejected) as err:
        admit(entry(), "tiny", KEYS)
    assert str(err.value) == "unreadable request (ZeroDivisionError: boom)"


def test_a_rejected_entrys_sender_is_told_only_where_it_may_be():
    assert salvage_reply(entry(params={"temperature": -1}), KEYS) == ("r1", ReplyTarget("channel", CHANNEL))
    for bad in (None, b"\xc1", entry(id=7), entry(id=...), entry(reply={"channel": "pagedserve:alive:x"}),
                entry(reply="nowhere"), msgpack.packb([1, 2])):
        assert salvage_reply(bad, KEYS) is None, bad
