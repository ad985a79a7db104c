"""WorkerInfo: what a worker tells the gateways with each heartbeat, one msgpack value per worker
(``Keys.worker_info``, expiring with the heartbeat). The facts fixed when it started (its context,
vocabulary, how it hashes blocks, its capacity) and its load now. The gateway's worker directory
reads these, and only these, for routing, admission, the context limit and ``/v1/models``; the
metrics hash beside it is for Prometheus alone.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields

from pagedserve.shared.protocol import ProtocolError, pack, unpack

WORKER_INFO_VERSION = 1


@dataclass(frozen=True)
class WorkerInfo:
    name: str  # the worker's consumer name
    model: str  # the served model name
    max_model_len: int  # the longest prompt + output it serves
    vocab_size: int  # token ids it accepts: [0, vocab_size)
    block_size: int  # with rope_switch: how it hashes a prompt's blocks (prefix routing)
    rope_switch: int
    max_num_seqs: int
    kv_cache_dtype: str = "auto"  # how its KV cache stores K/V (--kv-cache-dtype)
    kv_bytes_per_token: int = 0  # the KV cache's bytes for one token, all layers, scales included
    running: int = 0
    waiting: int = 0  # requests read (or taken from its own stream) but not running yet
    draining: bool = False  # stopping: it takes nothing new
    adapters: tuple[str, ...] = ()  # the LoRA adapters it holds, as NAME@DIGEST (their prefix-cache salt): request one by NAME as the model
    max_loras: int = 0  # adapters on its device at once; 0: LoRA is off there (it never loads one)

    def holds_adapter(self, name: str) -> bool:
        return holds_adapter(self.adapters, name)

    def encode(self) -> bytes:
        return pack({"v": WORKER_INFO_VERSION, **asdict(self)})

    @classmethod
    def decode(cls, data: bytes) -> "WorkerInfo":
        """ProtocolError for anything but a map of this version with every fact of the right type."""
        msg = unpack(data)
        if not isinstance(msg, dict) or msg.get("v") != WORKER_INFO_VERSION:
            raise ProtocolError(f"unsupported worker info version {msg.get('v') if isinstance(msg, dict) else None!r}", "v")
        values = {}
        for f in fields(cls):
            value = msg.get(f.name)
            kind = {"str": str, "int": int, "bool": bool, "tuple[str, ...]": list}[f.type]
            if value is None and f.default is not MISSING:  # a load figure left out
                value = list(f.default) if kind is list else f.default
            if type(value) is not kind or (kind is int and value < 0) or (kind is list and not all(type(v) is str for v in value)):
                raise ProtocolError(f"worker info {f.name} must be a {f.type}", f.name)
            values[f.name] = tuple(value) if kind is list else value
        return cls(**values)


def holds_adapter(keys: tuple[str, ...], name: str) -> bool:
    """Whether adapter ``name`` (any bytes) is among ``keys`` (NAME@DIGEST each)."""
    return any(adapter_name(key) == name for key in keys)


def adapter_name(key: str) -> str:
    """The adapter name of one of ``WorkerInfo.adapters`` (``NAME@DIGEST``; the digest has no ``@``)."""
    return key.rsplit("@", 1)[0]
