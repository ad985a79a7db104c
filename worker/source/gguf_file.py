"""One GGUF file, opened and checked: its architecture (mapped onto a supported family), its
metadata values, its tensors. Reading goes through the ``gguf`` package (llama.cpp's own reader);
what this adds is one clear error for a file that is not a GGUF, is truncated or is corrupt, and
for an architecture no family serves.

A GGUF names its architecture with llama.cpp's names; a Mixtral is a ``llama`` with experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# llama.cpp's architecture name -> our family (``worker/runner/models/families.py``); ``llama`` with
# ``llama.expert_count`` is Mixtral, and a Mistral is a ``llama`` too (transformers tells it by its name)
ARCHITECTURES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe", "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3_text",
}
MAGIC = b"GGUF"


class GGUFError(ValueError):
    """The file cannot be served: not a GGUF, truncated, corrupt, or an unsupported architecture."""


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    reader: object  # gguf.GGUFReader
    architecture: str  # as the file names it (llama.cpp's name)
    family: str  # the model_type that serves it

    def value(self, key: str, default=None):
        """A metadata value (``{arch}.`` expands to the file's architecture), or ``default``."""
        field = self.reader.fields.get(key.replace("{arch}", self.architecture))
        return default if field is None else field.contents()


def is_gguf(path: Path) -> bool:
    """A file that starts with the GGUF magic (whatever its name ends with)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def open_gguf(path: str | Path) -> GGUFFile:
    from gguf import GGUFReader

    path = Path(path)
    if not is_gguf(path):
        raise GGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        reader = GGUFReader(path)
        tensors = list(reader.tensors)
        end = max((t.data_offset + t.n_bytes for t in tensors), default=0)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, OSError) as err:
        raise GGUFError(f"{path} is a truncated or corrupt GGUF file: {err}") from None
    size = path.stat().st_size
    if end > size:
        raise GGUFError(f"{path} is a truncated GGUF file: its tensors need {end:,} bytes, the file has {size:,}")
    arch_field = reader.fields.get("general.architecture")
    architecture = arch_field.contents() if arch_field is not None else None
    family = ARCHITECTURES.get(architecture)
    if family == "llama" and reader.fields.get("llama.expert_count") is not None \
            and reader.fields["llama.expert_count"].contents():
        family = "mixtral"
    if family is None:
        raise GGUFError(f"{path}: GGUF architecture {architecture!r} is not supported; "
                        f"supported: {', '.join(sorted(ARCHITECTURES))} (llama with experts: mixtral)")
    return GGUFFile(path, reader, architecture, family)
