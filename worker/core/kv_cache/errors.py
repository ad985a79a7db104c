"""Errors the engine raises about its own state (as opposed to bad user input, see shared.errors)."""


class OutOfBlocksError(RuntimeError):
    """A pool had no block to hand out; the scheduler checks capacity first, so this is a bug."""
