"""``minipaged proxy``: one OpenAI-compatible address in front of a prefill server and a decode server.

Owns the request's route in disaggregated prefill (as vLLM's disaggregated-prefill proxy example):
each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to the producer
(``minipaged serve --kv-transfer-config '{..., "kv_role": "kv_producer"}'``) with ``max_tokens`` 1,
which computes the prompt and sends its KV blocks to the consumer before it answers; then the
request, unchanged, goes to the consumer (``"kv_role": "kv_consumer"``), which finds the prompt's
blocks, computes only its last token, decodes, and answers (streamed when asked). A prefill
server that fails or is unreachable does not fail the request: the consumer then prefills it
locally (``minipaged_proxy_prefill_failures`` counts it on the proxy's ``/health``).

    minipaged proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

import argparse
import json
from typing import Any

def prefill_body(body: dict) -> dict:
    """The producer's copy of a request: one token, not streamed (the prompt's blocks are what matters)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens", "n")}
    out["max_tokens"] = 1
    return out


def create_proxy_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0, transport: Any = None):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from .routes import add_generate_routes

    app = FastAPI(title="minipaged proxy", docs_url=None, redoc_url=None)
    state = {"requests": 0, "prefill_failures": 0, "last_prefill_error": None}
    client = httpx.AsyncClient(timeout=timeout_s, transport=transport)
    app.state.counts = state

    async def _prefill(path: str, body: dict, headers: dict) -> None:
        try:
            r = await client.post(prefill_url.rstrip("/") + path, json=prefill_body(body), headers=headers)
            if r.status_code != 200:
                raise RuntimeError(f"status {r.status_code}: {r.text[:200]}")
        except Exception as e:  # noqa: BLE001 - the consumer prefills locally instead
            state["prefill_failures"] += 1
            state["last_prefill_error"] = f"{type(e).__name__}: {e}"

    async def _route(path: str, kind: str, request: Request):  # kind: the consumer parses the body itself
        raw = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if isinstance(body, dict):
            state["requests"] += 1
            await _prefill(path, body, headers)
        url = decode_url.rstrip("/") + path
        if isinstance(body, dict) and body.get("stream"):
            req = client.build_request("POST", url, content=raw, headers=headers)
            resp = await client.send(req, stream=True)

            async def relay():
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()

            return StreamingResponse(relay(), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type", "text/event-stream"))
        r = await client.post(url, content=raw, headers=headers)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    add_generate_routes(app, _route)

    @app.get("/v1/models")
    async def models(request: Request):
        r = await client.get(decode_url.rstrip("/") + "/v1/models",
                             headers={k: v for k, v in request.headers.items() if k.lower() == "authorization"})
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health():
        ok = {}
        for name, url in (("prefill", prefill_url), ("decode", decode_url)):
            try:
                ok[name] = (await client.get(url.rstrip("/") + "/health")).status_code == 200
            except Exception:  # noqa: BLE001
                ok[name] = False
        return JSONResponse({**ok, **state}, status_code=200 if ok["decode"] else 503)

    return app


def add_proxy_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("proxy", help="disaggregated prefill: one address in front of a prefill and a decode server",
                       description=(__doc__ or "").strip().splitlines()[0])
    p.add_argument("--prefill", required=True, help="the kv_producer server's base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, help="the kv_consumer server's base URL, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(fn=run_proxy)
    return p


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    app = create_proxy_app(args.prefill, args.decode)
    print(f"minipaged proxy: http://{args.host}:{args.port}/v1 -> prefill {args.prefill}, decode {args.decode}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


__all__ = ["create_proxy_app", "prefill_body", "add_proxy_parser", "run_proxy"]
