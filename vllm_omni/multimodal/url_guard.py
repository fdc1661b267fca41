"""Where a media URL may lead: no server-side request forgery.

    target = await guard_url(httpx.URL(url), policy, shown)   # MediaError (a 400) when refused
    client.get(target.connect_url, headers=target.headers, extensions=target.extensions)

A client that names a URL makes the server fetch it, from inside the server's network. So a
host is resolved here, every address it resolves to must be public (not loopback, private,
shared, link-local, multicast, reserved or unspecified), and the connection then goes to the
address that was checked, not to a second lookup that a rebinding DNS server could answer
differently. HTTPS still verifies the certificate for the host name (TLS SNI). Redirects are
followed by the caller one hop at a time, each checked here again.

`--allowed-media-domains`: only those hosts (and their subdomains) are fetched, wherever they
resolve (the operator vouches for them). `--allow-private-media-urls`: internal addresses are
allowed for every host.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Any

import httpx

from vllm_omni.multimodal.media_policy import MediaError, MediaPolicy

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Target:
    connect_url: httpx.URL  # the URL with the checked address in place of the host name
    headers: dict[str, str] = field(default_factory=dict)  # Host: the name the client gave
    extensions: dict[str, Any] = field(default_factory=dict)  # sni_hostname for HTTPS


def is_public(address: IPAddress) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
    address = mapped or address
    return address.is_global and not address.is_multicast


def domain_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (a.lower().strip(".") for a in allowed))


async def guard_url(url: httpx.URL, policy: MediaPolicy, shown: str) -> Target:
    """Check `url` (http or https) against the policy; `shown` names it in errors."""
    allowed_domains, allow_private = policy.allowed_domains, policy.allow_private
    if url.scheme not in ("http", "https") or not url.host:
        raise MediaError(f"media URL {shown} must be an http(s) URL with a host")
    host = url.host
    listed = bool(allowed_domains) and domain_allowed(host, allowed_domains)
    if allowed_domains and not listed:
        raise MediaError(f"media URL {shown}: host {host!r} is not in --allowed-media-domains")
    trusted = listed or allow_private
    # Refused hosts get one message whether they are internal or do not resolve: the answer
    # must not tell a client which names the server's own DNS knows.
    refused = MediaError(f"media URL {shown}: refused, its host is not a public internet address or does not "
                         "resolve (start the server with --allowed-media-domains or --allow-private-media-urls "
                         "to fetch from internal hosts)")
    address = await _resolve(host, url.port or (443 if url.scheme == "https" else 80), shown,
                             None if trusted else refused)
    if not (trusted or is_public(address)):
        raise refused
    netloc = host if url.port is None else f"{host}:{url.port}"
    extensions = {"sni_hostname": host} if url.scheme == "https" else {}
    return Target(url.copy_with(host=str(address)), {"Host": netloc}, extensions)


async def _resolve(host: str, port: int, shown: str, refused: MediaError | None) -> IPAddress:
    """The address to connect to; every address the host has must pass, so the first is used.
    `refused`: the error for a name that does not resolve (None: say so)."""
    try:
        return _checked([ipaddress.ip_address(host)], shown)
    except ValueError:
        pass  # a name, not an address literal
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise refused or MediaError(f"media URL {shown}: cannot resolve its host") from None
    return _checked([ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos], shown)


def _checked(addresses: list[IPAddress], shown: str) -> IPAddress:
    if not addresses:
        raise MediaError(f"media URL {shown}: its host has no address")
    # A name with one internal address among public ones is refused as a whole: a client
    # cannot choose which one the connection would use.
    internal = [a for a in addresses if not is_public(a)]
    return internal[0] if internal else addresses[0]
