"""SSE framing, byte for byte: what every OpenAI client parses."""

from pagedserve.gateway import sse


def test_a_frame_is_one_data_line_and_a_blank_line():
    assert sse.frame({"a": 1, "b": "é\n"}) == b'data: {"a":1,"b":"\xc3\xa9\\n"}\n\n'
    assert sse.DONE == b"data: [DONE]\n\n"
