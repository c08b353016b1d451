"""An OpenAI-compatible HTTP server over one ``LLMEngine`` (``minipaged serve``).

Owns the HTTP side only: request schemas and errors (``protocol.py``), the one thread that
owns the engine (``engine_loop.py``), Prometheus metrics (``metrics.py``), the FastAPI routes
(``app.py``; the two generation routes' table, shared with the proxy, in ``routes.py``) and the command line (``cli.py``). It never schedules, samples or touches KV
blocks itself: every request goes through ``add_request`` / ``step`` / ``abort_request``.

Needs the ``serve`` extra: ``pip install "minipaged[serve]"`` (fastapi, uvicorn, prometheus-client).
"""
from __future__ import annotations

SERVE_EXTRA_HINT = 'the server needs the "serve" extra: pip install "minipaged[serve]" (fastapi, uvicorn, prometheus-client)'


def __getattr__(name):  # fastapi is optional: import it only when the server is asked for
    if name in ("create_app", "ServerConfig"):
        from . import app

        return getattr(app, name)
    if name == "EngineLoop":
        from .engine_loop import EngineLoop

        return EngineLoop
    raise AttributeError(f"module 'minipaged.server' has no attribute {name!r}")


__all__ = ["create_app", "ServerConfig", "EngineLoop", "SERVE_EXTRA_HINT"]
