"""Queue entries -> requests this worker will run, or the reason it will not. One path for every
fault: whatever an entry holds (not msgpack, a wrong schema, values that make a constructor throw,
a reply target outside the reply namespaces), ``admit`` returns a request or raises ``Rejected``;
the service then dead-letters the entry and tells the sender when it can."""

from __future__ import annotations

from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import ReplyTarget, WireRequest, unpack


class Rejected(Exception):
    """An entry this worker will never run, with the reason for the dead-letter stream."""


def admit(data: bytes | None, model: str, keys: Keys) -> WireRequest:
    try:
        req = WireRequest.decode(data or b"")
    except InvalidRequestError as err:
        raise Rejected(str(err)) from None
    except Exception as err:  # anything the decoder did not foresee is still the entry's fault
        raise Rejected(f"unreadable request ({type(err).__name__}: {err})") from None
    if req.model != model:
        raise Rejected(f"this worker serves {model!r}, not {req.model!r}")
    if not keys.allows_reply(req.reply.kind, req.reply.name):
        raise Rejected(f"reply target {req.reply.kind} {req.reply.name!r} is outside "
                       f"{keys.prefix}:replies:* (channels) and {keys.prefix}:results:* (streams)")
    return req


def salvage_reply(data: bytes | None, keys: Keys) -> tuple[str, ReplyTarget] | None:
    """The request id and an allowed reply target of a rejected entry, if they can be read at all."""
    try:
        msg = unpack(data or b"")
        request_id, target = msg["id"], ReplyTarget.from_wire(msg["reply"])
    except Exception:  # anything unreadable: there is nobody to tell
        return None
    if not isinstance(request_id, str) or not keys.allows_reply(target.kind, target.name):
        return None
    return request_id, target
