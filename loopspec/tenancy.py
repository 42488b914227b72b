"""Who a served request decodes for: API keys and scopes (the standard library only, so the command
line checks a key without loading torch).

A scope is the tenant of a request: the key it came with — by its place in the server's list, never
its text — and its OpenAI `user` field. The shared suffix library (loopspec/suffix_library.py)
proposes to a request only what earlier requests of its scope wrote: text never crosses keys, a
request that names a `user` shares only with the same key's requests naming the same user, and the
requests naming none share with the key's others naming none. Without keys every request's key is
None: all user-less requests share one scope.
"""

from __future__ import annotations


def api_key_problem(key) -> str:
    """What makes `key` unusable as an API key ('' when nothing): it travels in a header."""
    if not isinstance(key, str) or not key:
        return "an API key must be a non-empty string"
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        return "an API key must be printable ASCII without spaces (it travels in the Authorization header)"
    return ""


def request_scope(key: int | None, user: str | None) -> tuple[int | None, str | None]:
    """The scope of a request that came with configured key number `key` (None: the server has no
    keys) naming `user` (None or '': none)."""
    return key, user or None
