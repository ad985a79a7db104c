"""Answers as clients read them: OpenAI's response and chunk objects, an answer's thinking, text and
tool calls."""
