"""A token id's text as a logprob entry shows it, decoded once per id (the worker's wire events and
the offline API's ``Logprob.decoded_token`` both show it)."""

from __future__ import annotations


class TokenPieces:
    """``tokenizer.decode([id])`` per token id, cached."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._pieces: dict[int, str] = {}  # at most one entry per vocabulary id

    def __call__(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._tokenizer.decode([token_id])
        return piece
