"""Signing a delivery per Standard Webhooks, as OpenAI signs its webhooks (and as the official SDKs'
``webhooks.unwrap`` verifies them): ``webhook-signature: v1,<base64 HMAC-SHA256>`` of
``{webhook-id}.{webhook-timestamp}.{body}``, keyed with the base64-decoded part of the
``whsec_`` secret. Receivers refuse a timestamp more than a few minutes away from their clock, so
each attempt is signed afresh, at the time it is sent."""

import base64
import hashlib
import hmac
import time

from lmsp_core.wire.webhooks import SECRET_PREFIX


def key(secret: str) -> bytes:
    """The HMAC key of a ``whsec_`` secret."""
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header's value."""
    mac = hmac.new(key(secret), f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def headers(secret: str, message_id: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt (signed now unless ``timestamp`` is given)."""
    when = int(time.time()) if timestamp is None else timestamp
    return {"webhook-id": message_id, "webhook-timestamp": str(when),
            "webhook-signature": signature(secret, message_id, when, body)}
