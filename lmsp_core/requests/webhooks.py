"""Webhooks as a request asks for them: an endpoint's URL and event types, checked before anything
is stored (``400 invalid_webhook_url``, ``400 unknown_event_type``). Whether the URL's host
resolves to an address the service may send to is the API's check (``api.background.webhooks.targets``),
when it is resolved."""

import re
import unicodedata
import urllib.parse

from lmsp_core.wire.errors import InvalidRequest
from lmsp_core.wire.webhooks import EVENT_TYPES, MAX_URL_LENGTH


def _ipv6() -> str:
    """An IPv6 address as RFC 3986 spells it (its ``IPv6address`` rule), which ``urlsplit`` accepts
    between brackets."""
    h16 = "[0-9A-Fa-f]{1,4}"
    octet = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
    ls32 = rf"({h16}:{h16}|{octet}(\.{octet}){{3}})"
    # after "::", what may follow when up to 1, 2, ... 7 groups come before it
    after = [f"({h16}:){{4}}{ls32}", f"({h16}:){{3}}{ls32}", f"({h16}:){{2}}{ls32}", f"{h16}:{ls32}", ls32, h16, ""]
    forms = [f"({h16}:){{6}}{ls32}", f"::({h16}:){{5}}{ls32}",
             *(f"(({h16}:){{0,{most}}}{h16})?::{tail}" for most, tail in enumerate(after))]
    return "|".join(f"({form})" for form in forms)


_PORT = "0*(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
# the URLs check_url accepts, for the OpenAPI document (and checked last, so that the two agree): an
# http(s) URL of visible ASCII characters (RFC 3986; a client percent-encodes others), a DNS name or
# an IP address, a port from 1, no credentials, no fragment
URL_PATTERN = (rf"^[Hh][Tt][Tt][Pp][Ss]?://([A-Za-z0-9._-]+|\[({_ipv6()})\])(:({_PORT})?)?"
               r"""([/?][!"$-~]*)?$""")
_URL = re.compile(URL_PATTERN)


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
    if not _URL.fullmatch(url):
        raise refuse("is not an http(s) URL of visible ASCII characters (RFC 3986; percent-encode others)")
    return url


def check_events(events: list[str]) -> list[str]:
    """The event types, each known (``400 unknown_event_type``), without repeats, in their order."""
    for event_type in events:
        if event_type not in EVENT_TYPES:
            raise InvalidRequest(f"Unknown event type {event_type[:100]!r}; the types are {', '.join(EVENT_TYPES)}.",
                                 code="unknown_event_type")
    return list(dict.fromkeys(events))
