"""The console's guards against other local users and other websites (pure functions).

- Session: the local console prints a URL with a random token once; presenting it sets an HttpOnly
  SameSite=Strict cookie, which every later request must carry. Another user of the machine can
  reach 127.0.0.1 but does not know the token.
- Name: cookies are not kept apart by port, so a cookie for 127.0.0.1 would also go to a server
  another user runs on another port of it. Each local console has a host name of its own,
  tether-<random>.localhost (browsers resolve *.localhost to loopback themselves), and its
  host-only cookie goes to that name only.
- Host: a page of another site whose name was re-bound to 127.0.0.1 (DNS rebinding) sends its own
  host name; only the console's own name is served.
- Writes: a POST must come from the console's own origin (browsers name it in Origin), or, from a
  client that sends no Origin, carry the X-Tether-Console header, which a page of another origin
  cannot send without a CORS preflight the console never grants.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Mapping
from urllib.parse import urlsplit

CSRF_HEADER = "x-tether-console"
SESSION_COOKIE = "tether_console"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def same_secret(given: str | None, expected: str) -> bool:
    """Constant time: the comparison must not tell how much of a guess was right."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def local_host(port: int) -> str:
    """A new console's own Host: unguessable, so no other server is ever reached by that name."""
    return f"tether-{secrets.token_hex(8)}.localhost:{port}"


def host_allowed(host: str | None, allowed: frozenset[str] | None) -> bool:
    """None: any host (behind the gateway, where the cookie, not the address, is the credential)."""
    return allowed is None or (host or "").lower() in allowed


# Sent with every answer: no page of another site may frame the console (a click on a framed
# Approve would be the user's), and the pages run the console's own script and style only.
HEADERS = ((b"x-frame-options", b"DENY"),
           (b"content-security-policy",
            b"default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
           (b"x-content-type-options", b"nosniff"),
           # Not no-referrer: that would make a form POST's Origin "null", refused as cross-site.
           (b"referrer-policy", b"same-origin"))


def write_allowed(method: str, headers: Mapping[str, str], own_host: str) -> bool:
    """`own_host` is the Host the request was sent to; an Origin is compared by host and port only,
    since behind a TLS-terminating proxy the console sees http where the browser saw https."""
    if method.upper() in SAFE_METHODS:
        return True
    origin = headers.get("origin")
    if origin is not None:
        return bool(own_host) and urlsplit(origin).netloc.lower() == own_host.lower()
    return headers.get(CSRF_HEADER) == "1"

