"""Where a webhook may be sent: the check against server-side request forgery (SSRF).

A webhook's URL is chosen by a tenant, and the service sends to it from inside its network; so the
host's addresses are checked when the endpoint is created and again at every attempt (a name may
resolve elsewhere later), and the attempt connects to the address that was checked (the URL's host
is still sent as ``Host`` and as the TLS server name, so certificates are verified against it): a
name that resolves to a public address for the check and to a private one for the connection
gains nothing. Refused, unless ``LMSP_WEBHOOK_ALLOW_PRIVATE``: any address that is not global
(loopback, link-local, private, unique-local, unspecified, shared, reserved, documentation) and
multicast, also where an IPv6 address carries an IPv4 one (mapped, NAT64, 6to4, Teredo).
"""

import asyncio
import ipaddress
import socket
import urllib.parse
from dataclasses import dataclass

from lmsp_core.wire.errors import InvalidRequest

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class TargetRefused(InvalidRequest):
    """The URL's host resolves to an address this service does not send to."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail, code="webhook_url_not_allowed")


class TargetUnresolved(InvalidRequest):
    """The URL's host has no address (now): what DNS says, not the URL's form (invalid_webhook_url)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail, code="webhook_url_unresolved")


@dataclass(frozen=True)
class Target:
    """A checked URL and the address an attempt connects to."""

    url: str
    hostname: str  # as the URL spells it (IDNA-encoded), for Host and TLS
    address: IPAddress


def _embedded(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries, where it carries one."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    return ip.teredo[1] if ip.teredo is not None else None


def refusal(ip: IPAddress) -> str | None:
    """Why an address is refused (the kind of address), or None for a global unicast one."""
    inner = _embedded(ip)
    if inner is not None and (why := refusal(inner)) is not None:
        return why
    for kind, flag in (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback),
                       ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                       ("private", ip.is_private)):
        if flag:
            return kind
    return None if ip.is_global else "non-global"


async def addresses(hostname: str, port: int) -> list[IPAddress]:
    """The host's addresses (an IP literal is its own); empty when it does not resolve."""
    try:
        return [ipaddress.ip_address(hostname)]
    except ValueError:
        pass
    try:
        found = await asyncio.get_running_loop().getaddrinfo(hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    # an IPv6 address may carry a zone (fe80::1%eth0): the part before it is the address
    return list(dict.fromkeys(ipaddress.ip_address(str(entry[4][0]).partition("%")[0]) for entry in found))


async def resolve(url: str, allow_private: bool) -> Target:
    """The address to send ``url`` to (its first); raises ``TargetRefused`` when any of the host's
    addresses is refused, ``TargetUnresolved`` when it has none. The URL is one ``check_url`` passed."""
    parts = urllib.parse.urlsplit(url)
    hostname = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    found = await addresses(hostname, port)
    if not found:
        raise TargetUnresolved(f"The webhook URL's host {hostname[:200]!r} does not resolve.")
    if not allow_private:
        for ip in found:
            if (why := refusal(ip)) is not None:
                raise TargetRefused(f"The webhook URL's host resolves to a {why} address, which this service "
                                    "does not send to (docs/protocol.md, \"Webhooks\").")
    return Target(url=url, hostname=hostname, address=found[0])
