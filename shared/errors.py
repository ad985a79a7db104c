"""Typed errors for bad input. Each names the offending field so it can become an HTTP 400."""


class InvalidRequestError(ValueError):
    """A request or parameter that can never be served as given."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
