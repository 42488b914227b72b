"""The one error type every user-facing entry point turns into a clear message (exit code 2)."""


class LoopspecError(Exception):
    """Bad input from the user: wrong path, mismatched models, invalid parameters, ..."""


class InvalidValue(LoopspecError, ValueError):
    """A parameter outside what it may be: a ValueError to Python callers, one line on the command line."""
