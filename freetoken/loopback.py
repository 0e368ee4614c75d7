"""Whether a host name or address is this machine's loopback: the server binds there without an API key, and
`ft eval` reads this machine's CPU times only for an endpoint there."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1); a name, an unparsable or a remote address: False."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
