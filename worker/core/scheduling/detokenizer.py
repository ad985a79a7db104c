"""Incremental detokenization with stop strings.

Text is released only when it is final: never half of a multi-byte character (a decode that ends
in U+FFFD waits for more tokens, unless the sequence ends there: then its text is what ``decode``
gives, replacement character included) and never text that could be the start of a stop string. When a
stop string appears, the text before it is released and the string itself is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Decoding a window that starts a few tokens back keeps spacing right for tokenizers whose
# pieces depend on their left neighbour (SentencePiece's leading-space marker).
CONTEXT_TOKENS = 5


@dataclass
class DetokenizerState:
    prefix_offset: int
    read_offset: int
    text: str = ""  # everything decoded so far (stop string removed once found)
    emitted: int = 0  # how much of ``text`` has been released
    stopped: bool = False
    stop_string: str | None = None  # the stop string that ended the text (the earliest found)
    tokens_seen: int = field(default=0)


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @staticmethod
    def new_state(prompt_len: int) -> DetokenizerState:
        start = max(prompt_len - CONTEXT_TOKENS, 0)
        return DetokenizerState(prefix_offset=start, read_offset=prompt_len, tokens_seen=prompt_len)

    def update(
        self, state: DetokenizerState, token_ids: list[int], stop: tuple[str, ...], skip_special: bool, final: bool
    ) -> str:
        """Consume the tokens appended since the last call; return the text that became final.

        ``final``: the sequence ended, so any held-back text is released too."""
        if not state.stopped:
            for end in range(state.tokens_seen + 1, len(token_ids) + 1):
                self._decode_one(state, token_ids[:end], skip_special)
            state.tokens_seen = len(token_ids)
            if final:  # the sequence ended inside a character: its bytes are text now, as decode gives them
                self._decode_one(state, token_ids, skip_special, partial=True)
            if stop:
                self._find_stop(state, stop)
        safe = len(state.text) if (final or state.stopped) else len(state.text) - _held_back(state.text, stop)
        delta = state.text[state.emitted : safe] if safe > state.emitted else ""
        state.emitted = max(state.emitted, safe)
        return delta

    def _decode_one(self, state: DetokenizerState, ids: list[int], skip_special: bool, partial: bool = False) -> None:
        """Text of the tokens past ``read_offset``, once it does not end inside a character
        (``partial``: even then)."""
        decode = self.tokenizer.decode
        prefix = decode(ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip_special)
        full = decode(ids[state.prefix_offset :], skip_special_tokens=skip_special)
        if len(full) > len(prefix) and (partial or not full.endswith("\ufffd")):
            state.text += full[len(prefix) :]
            state.prefix_offset, state.read_offset = state.read_offset, len(ids)

    @staticmethod
    def _find_stop(state: DetokenizerState, stop: tuple[str, ...]) -> None:
        longest = max(len(s) for s in stop)
        search_from = max(0, state.emitted - longest)
        hits = [(i, s) for i, s in ((state.text.find(s, search_from), s) for s in stop) if i >= 0]
        if hits:
            at, state.stop_string = min(hits, key=lambda hit: hit[0])
            state.text = state.text[:at]
            state.stopped = True


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
