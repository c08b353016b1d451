"""What keeps a server on a shared machine to its own clients: API key, JSON bodies, Host names.

Owns one ASGI middleware, :class:`Guard`, that answers before any route runs:

- ``api_key``: every ``/v1/...`` route needs ``Authorization: Bearer <key>`` (as ``vllm serve
  --api-key`` does); ``/health`` and ``/metrics`` stay open. A wrong or missing key is a 401.
- a ``POST`` body must say ``Content-Type: application/json`` (415 otherwise). A web page can send
  ``text/plain`` or a form to any address without asking; JSON needs the server's consent (a CORS
  preflight, which this server never grants), so a page on another site cannot drive it.
- ``allowed_hosts``: when the server listens on a loopback address, a ``Host`` header naming
  anything else is refused (421), so a site whose DNS name is re-pointed at 127.0.0.1 (DNS
  rebinding) cannot reach it from a browser on this machine.

And :func:`unencodable`: the first string in a decoded JSON body (a field name or a value) that
cannot be encoded as UTF-8 (a lone surrogate such as ``"\\udcff"``), so it is a 400, never a 500.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any

LOOPBACK_NAMES = ("localhost", "localhost.")


def is_loopback(host: str) -> bool:
    """``127.0.0.1``, ``::1``, ``[::1]``, ``localhost``: an address only this machine reaches."""
    h = host.strip().lower()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """A Host header's name without its port: ``127.0.0.1:8000`` -> ``127.0.0.1``, ``[::1]:80`` -> ``::1``."""
    h = header.strip()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end > 0 else h
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    return h  # a bare IPv6 address (no brackets) or a plain name


def _error(status: int, message: str, code: str, type_: str = "invalid_request_error") -> tuple[int, bytes]:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return status, json.dumps(body, ensure_ascii=True).encode()


class Guard:
    """ASGI middleware: refuse a request before its route runs (see the module's docstring).

    ``allowed_hosts``: None lets any Host through; "loopback" allows only loopback names and
    addresses; a tuple of names allows those (compared without the port, case-insensitively).
    """

    def __init__(self, app: Any, api_key: str | None = None, allowed_hosts: Any = None) -> None:
        self.app = app
        self.api_key = api_key or None
        self.allowed_hosts = allowed_hosts

    def _host_ok(self, headers: dict[bytes, bytes]) -> bool:
        if self.allowed_hosts is None:
            return True
        raw = headers.get(b"host")
        if raw is None:  # HTTP/1.0 without a Host: it names nothing else (browsers always send one)
            return True
        name = host_name(raw.decode("latin-1")).lower()
        if self.allowed_hosts == "loopback":
            return is_loopback(name)
        return name in {h.lower() for h in self.allowed_hosts}

    def check(self, scope: dict) -> tuple[int, bytes] | None:
        headers = dict(scope.get("headers") or [])
        if not self._host_ok(headers):
            shown = headers.get(b"host", b"").decode("latin-1")[:100]
            return _error(421, f"this server answers only for this machine's own names (localhost, 127.0.0.1, ::1), "
                               f"not for the Host {shown!r}: use http://127.0.0.1:PORT, or start the server with "
                               "--host 0.0.0.0 (and --api-key) to serve other names", "invalid_host")
        path = scope.get("path", "")
        if self.api_key is not None and path.startswith("/v1") and scope.get("method") != "OPTIONS":
            auth = headers.get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.api_key.encode("utf-8")):
                what = "no Authorization header" if not auth else "a wrong API key"
                return _error(401, f"{what}: this server needs 'Authorization: Bearer <key>' with the key it was "
                                   "started with (--api-key or MINIPAGED_API_KEY)", "invalid_api_key")
        if scope.get("method") == "POST":
            ctype = headers.get(b"content-type", b"").decode("latin-1")
            media = ctype.split(";", 1)[0].strip().lower()
            if media != "application/json":
                shown = ctype[:80] if ctype else "no Content-Type"
                return _error(415, f"the body must be JSON, sent with 'Content-Type: application/json' (got {shown!r})",
                              "unsupported_media_type")
        return None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") == "http":
            refused = self.check(scope)
            if refused is not None:
                status, body = refused
                extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _bad_position(s: str) -> int | None:
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def unencodable(data: Any) -> str | None:
    """Where the first string that UTF-8 cannot encode sits in ``data``, said for a person; None if none.

    E.g. ``{"a\\udcffb": 1}`` -> "the field name 'a\\udcffb' (at $) holds a lone surrogate \\udcff at position 1".
    Walks without recursion, so any depth json.loads accepted is fine.
    """
    stack: list[tuple[Any, str]] = [(data, "$")]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, str):
            pos = _bad_position(obj)
            if pos is not None:
                return f"the string at {path} holds a lone surrogate {ascii(obj[pos])[1:-1]} at position {pos}"
        elif isinstance(obj, dict):
            for k in obj:
                pos = _bad_position(k) if isinstance(k, str) else None
                if pos is not None:
                    return (f"the field name {ascii(k)} (in {path}) holds a lone surrogate {ascii(k[pos])[1:-1]} "
                            f"at position {pos}")
            for k, v in reversed(list(obj.items())):
                stack.append((v, f"{path}.{k}"))
        elif isinstance(obj, list):
            for i in range(len(obj) - 1, -1, -1):
                stack.append((obj[i], f"{path}[{i}]"))
    return None


__all__ = ["Guard", "is_loopback", "host_name", "unencodable"]
