"""Webhooks as a request asks for them: an endpoint's URL and event types, checked before anything
is stored (``400 invalid_webhook_url``, ``400 unknown_event_type``). Whether the URL's host
resolves to an address the service may send to is the API's check (``api.background.webhooks.targets``),
when it is resolved."""

import re
import unicodedata
import urllib.parse

from lmsp_core.wire.errors import InvalidRequest
from lmsp_core.wire.webhooks import EVENT_TYPES, MAX_URL_LENGTH


def check_url(url: str) -> str:
    """``url`` if it is an absolute http(s) URL this service can send to (its address is checked
    when it is resolved, by the API); ``400 invalid_webhook_url`` otherwise."""
    def refuse(why: str) -> InvalidRequest:
        return InvalidRequest(f"The webhook URL {url[:200]!r} {why}.", code="invalid_webhook_url")

    if len(url) > MAX_URL_LENGTH or any(unicodedata.category(char)[0] in "CZ" for char in url):
        raise refuse(f"is longer than {MAX_URL_LENGTH} characters or holds spaces or control characters")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise refuse("is not a URL") from None
    if parts.scheme not in ("http", "https"):
        raise refuse("is not an http or https URL")
    if not parts.hostname or not re.fullmatch(r"[A-Za-z0-9.:_\-\[\]]+", parts.netloc.rpartition("@")[2]):
        raise refuse("has no host (or one that is not a DNS name or an IP address)")
    if parts.username is not None or parts.password is not None:
        raise refuse("carries credentials; put them in the path or query instead")
    if parts.fragment or url.endswith("#"):
        raise refuse("has a fragment, which is never sent")
    if port == 0:
        raise refuse("names port 0")
    return url


def check_events(events: list[str]) -> list[str]:
    """The event types, each known (``400 unknown_event_type``), without repeats, in their order."""
    for event_type in events:
        if event_type not in EVENT_TYPES:
            raise InvalidRequest(f"Unknown event type {event_type[:100]!r}; the types are {', '.join(EVENT_TYPES)}.",
                                 code="unknown_event_type")
    return list(dict.fromkeys(events))
