"""The HTTP routes, one file per API family: OpenAI's completions and chat, Responses, Anthropic's
Messages, embeddings, LoRA adapters, utilities, the dashboard and the docs."""
