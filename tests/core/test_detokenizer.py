"""Incremental detokenization: no broken UTF-8, stop strings held back and removed."""

import pytest

from pagedserve.worker.core.scheduling.detokenizer import Detokenizer
from pagedserve.worker.source.demo_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(400)


def stream(tokenizer, text, stop=(), prompt=(), chunk=1):
    detok = Detokenizer(tokenizer)
    ids = list(prompt) + tokenizer.encode(text)
    state = detok.new_state(len(prompt))
    deltas = []
    for end in range(len(prompt) + 1, len(ids) + 1, chunk):
        deltas.append(detok.update(state, ids[:end], tuple(stop), True, final=False))
        if state.stopped:
            break
    deltas.append(detok.update(state, ids, tuple(stop), True, final=True))
    return deltas, state


def test_deltas_rebuild_the_text_and_never_split_a_character(tokenizer):
    text = "café naïve 東京 Москва 🙂 done"
    deltas, _ = stream(tokenizer, text, prompt=tokenizer.encode("Hello "))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_is_cut_and_not_returned(tokenizer):
    deltas, state = stream(tokenizer, "the quick brown fox jumps over", stop=["fox"])
    assert "".join(deltas) == "the quick brown "
    assert state.stopped


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode("abc STO")
    state = detok.new_state(0)
    released = detok.update(state, ids, ("STOP",), True, final=False)
    assert released == "abc "  # "STO" could still become "STOP"
    more = tokenizer.encode("abc STOVE")
    assert detok.update(state, more, ("STOP",), True, final=False) == "STOVE"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, _ = stream(tokenizer, "one two three four", stop=["four", "two"], chunk=3)
    assert "".join(deltas) == "one "


def test_special_tokens_are_skipped_on_request(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id]
    kept, skipped = detok.new_state(0), detok.new_state(0)
    assert detok.update(skipped, ids, (), True, final=True) == "hi"
    assert detok.update(kept, ids, (), False, final=True) == "hi<|eos|>"
