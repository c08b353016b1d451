"""The OpenAI generation routes, in one place for the server (``app.py``) and the
disaggregated-prefill proxy (``proxy.py``): their paths, the request kind each body is parsed as
(``protocol.parse_request``), and how an app takes them."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request

GENERATE_ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


def add_generate_routes(app: FastAPI, handle: Callable[[str, str, Request], Awaitable[Any]]) -> None:
    """``POST`` each of ``GENERATE_ROUTES`` on ``app``, answered by ``await handle(path, kind, request)``;
    each route is named by its path (``completions``, ``chat_completions``)."""

    def endpoint_of(path: str, kind: str):
        async def endpoint(request: Request):
            return await handle(path, kind, request)

        return endpoint

    for path, kind in GENERATE_ROUTES.items():
        app.post(path, name=path.removeprefix("/v1/").replace("/", "_"))(endpoint_of(path, kind))
