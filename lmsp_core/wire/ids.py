"""Identifiers: a prefix plus 26 Crockford base32 characters, shaped like a ULID.

All 128 bits are random (the ULID time prefix is not used), so an id cannot be guessed
from another one; ordering comes from ``created_at`` instead.
"""

import hashlib
import secrets

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_LENGTH = 26  # 130 bits of base32: the top character only takes 0-7, as in a ULID


def _ulid(value: int) -> str:
    chars = []
    for _ in range(_LENGTH):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def new_id(prefix: str) -> str:
    """A new id such as ``resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF``."""
    return f"{prefix}_{_ulid(secrets.randbits(128))}"


def derived_id(prefix: str, seed: str) -> str:
    """The same id for the same ``seed`` every time (an input item stored without one, named by its
    task's id and its place); as hard to guess as the seed."""
    return f"{prefix}_{_ulid(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:16], 'big'))}"


def is_id(value: str, prefix: str) -> bool:
    """Whether ``value`` is shaped like an id with this prefix (cheap guard before Redis look-ups)."""
    head, sep, body = value.partition("_")
    return (
        sep == "_"
        and head == prefix
        and len(body) == _LENGTH
        and body[0] in "01234567"
        and all(c in _CROCKFORD for c in body)
    )


def pattern(prefix: str) -> str:
    """A regular expression (without anchors) of the ids with this prefix, as ``is_id`` checks them."""
    return f"{prefix}_[0-7][{_CROCKFORD}]{{{_LENGTH - 1}}}"


TASK = "task"
BATCH = "batch"
FILE = "file"
CONVERSATION = "conv"
RESPONSE = "resp"
MESSAGE = "msg"
FUNCTION_CALL = "fc"
FUNCTION_CALL_OUTPUT = "fco"
CALL = "call"
REASONING = "rs"
