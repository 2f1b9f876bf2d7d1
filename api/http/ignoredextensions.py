"""``LMSP-Ignored-Extensions``: tells a client which of its request's extensions had no effect.

The value is a comma-separated list of the names, each percent-encoded (UTF-8) where it has
characters other than visible ASCII, or ``%`` and ``,``; the header is absent when nothing was
ignored. Requests with at most 64 extension names of at most 128 characters keep it bounded.
"""

from urllib.parse import quote

from api.process import Services
from lmsp_core import wire
from lmsp_core.requests import extensions

IGNORED_EXTENSIONS_HEADER = "LMSP-Ignored-Extensions"

# visible ASCII except the percent sign (the escape) and the comma (the separator)
_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in "%,")


def ignored_extensions(services: Services, request: wire.ResponseRequest) -> dict[str, str]:
    """The header for a request that was accepted (its model exists), or no header."""
    names = extensions.ignored(request, services.catalog.get(request.model))
    if not names:
        return {}
    return {IGNORED_EXTENSIONS_HEADER: ", ".join(quote(name, safe=_SAFE) for name in names)}
