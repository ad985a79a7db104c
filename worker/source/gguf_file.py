"""One GGUF file, opened and checked: its architecture (mapped onto a supported family), its
metadata values, its tensors; one clear error for a file that is not a GGUF, is truncated or is
corrupt, and for an architecture no family serves.

The header is read here, not by the ``gguf`` package's reader, which turns every metadata value
into numpy views, a tokenizer's vocabulary and merges included: 11.8 of the 16.9 s the 1.5B Qwen
coder took to load (151,936 tokens). The weights need the scalar values and the tensors' places,
so arrays are stepped over (their length kept), and the tensors' types and sizes come from
``gguf``'s tables.

A GGUF names its architecture with llama.cpp's names; a Mixtral is a ``llama`` with experts.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# llama.cpp's architecture name -> our family (``worker/runner/models/families.py``); ``llama`` with
# ``llama.expert_count`` is Mixtral, and a Mistral is a ``llama`` too (transformers tells it by its name)
ARCHITECTURES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe", "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3_text",
}
MAGIC = b"GGUF"


class GGUFError(ValueError):
    """The file cannot be served: not a GGUF, truncated, corrupt, or an unsupported architecture."""


SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
PLAIN_FORMATS = frozenset({"F32", "F16", "BF16"})  # a matrix's formats that are not quantized
PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
         "I64": np.int64}  # GGUF types stored as numpy values; the others as bytes


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array, stepped over: its element type and length."""

    element_type: int
    length: int


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor's place in the file: ``shape`` as GGUF lists it (innermost first), ``raw_shape`` and
    ``raw_dtype`` as numpy reads its bytes (a quantized matrix: uint8 ``[rows, row bytes]``)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int  # from the file's start
    n_bytes: int
    raw_dtype: type
    raw_shape: tuple[int, ...]


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    values: dict  # metadata: scalars and strings as they are, arrays as GGUFArray
    tensors: list[GGUFTensor]
    architecture: str  # as the file names it (llama.cpp's name)
    family: str  # the model_type that serves it

    def value(self, key: str, default=None):
        """A metadata value (``{arch}.`` expands to the file's architecture), or ``default``."""
        return self.values.get(key.replace("{arch}", self.architecture), default)


U64 = struct.Struct("<Q")


class _Cursor:
    """Reads a GGUF header's little-endian fields from a memory map."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.at = data, 0

    def unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.at + length > len(self.data):
            raise ValueError(f"a string of {length} bytes runs past the end")
        text = bytes(self.data[self.at:self.at + length]).decode("utf-8")
        self.at += length
        return text

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            element, length = self.unpack("<I"), self.unpack("<Q")
            if element == STRING:  # each string: its length, then its bytes (a vocabulary: 150k of them)
                at, data, length_at = self.at, self.data, U64.unpack_from
                for _ in range(length):
                    at += 8 + length_at(data, at)[0]
                self.at = at
            elif element in SCALARS:
                self.at += length * struct.calcsize(SCALARS[element])
            else:
                raise ValueError(f"an array of value type {element}")
            return GGUFArray(element, length)
        if kind not in SCALARS:
            raise ValueError(f"metadata value type {kind}")
        return self.unpack(SCALARS[kind])


def _read_header(path: Path) -> tuple[dict, list[GGUFTensor]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        if cursor.unpack("<4s") != MAGIC:
            raise ValueError("no GGUF magic")
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}")
        tensor_count, value_count = cursor.unpack("<Q"), cursor.unpack("<Q")
        values = {}
        for _ in range(value_count):
            key = cursor.string()
            values[key] = cursor.value(cursor.unpack("<I"))
        places = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
            places.append((name, dims, GGMLQuantizationType(cursor.unpack("<I")), cursor.unpack("<Q")))
        align = int(values.get("general.alignment", 32))
        start = -(-cursor.at // align) * align
    tensors = []
    for name, dims, kind, offset in places:
        elements = int(np.prod(dims, dtype=np.int64))
        block, block_bytes = GGML_QUANT_SIZES[kind]
        numpy_shape = tuple(reversed(dims))
        plain = PLAIN.get(kind.name)
        raw_shape = numpy_shape if plain else (*numpy_shape[:-1], numpy_shape[-1] // block * block_bytes)
        tensors.append(GGUFTensor(name, kind, dims, start + offset, elements * block_bytes // block,
                                  plain or np.uint8, raw_shape))
    return values, tensors


def is_gguf(path: Path) -> bool:
    """A file that starts with the GGUF magic (whatever its name ends with)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    if not is_gguf(path):
        raise GGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        values, tensors = _read_header(path)
        end = max((t.data_offset + t.n_bytes for t in tensors), default=0)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, OSError, struct.error) as err:
        raise GGUFError(f"{path} is a truncated or corrupt GGUF file: {err}") from None
    size = path.stat().st_size
    if end > size:
        raise GGUFError(f"{path} is a truncated GGUF file: its tensors need {end:,} bytes, the file has {size:,}")
    architecture = values.get("general.architecture")
    family = ARCHITECTURES.get(architecture)
    if family == "llama" and values.get("llama.expert_count"):
        family = "mixtral"
    if family is None:
        raise GGUFError(f"{path}: GGUF architecture {architecture!r} is not supported; "
                        f"supported: {', '.join(sorted(ARCHITECTURES))} (llama with experts: mixtral)")
    return GGUFFile(path, values, tensors, architecture, family)
