"""``minipaged serve``: its argument parser and what it runs.

Owns the command line of the server. The engine's options are made from ``EngineConfig``'s
fields (one flag per field, never declared again here), so a new engine setting is a new flag
by itself. ``add_serve_parser(subparsers)`` plugs into ``minipaged``'s parser. The load
generator's command (``minipaged bench serve``) is the bench's (``minipaged.bench.serve``).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from . import SERVE_EXTRA_HINT

# Engine settings the server decides itself: a server runs for days, and a per-step trace grows.
SERVER_FIXED = {"record_trace": False}


def _engine_flags(p: argparse.ArgumentParser) -> None:
    from ..flags import add_engine_flags

    add_engine_flags(p, skip={k: f"always {v} in the server" for k, v in SERVER_FIXED.items()})
    p.add_argument("--attention", default="auto", choices=["auto", "torch", "triton", "reference"],
                   help="the paged-attention backend (default auto)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig/Parts keywords a parsed command line gives (unset flags keep the defaults)."""
    from ..flags import engine_kwargs as given

    kw = given(args, skip=SERVER_FIXED)
    kw.update(SERVER_FIXED)
    kw["attention"] = args.attention
    return kw


def api_key_of(args: argparse.Namespace) -> str | None:
    """--api-key, else the MINIPAGED_API_KEY environment variable, else None (no key)."""
    key = getattr(args, "api_key", None)
    if key is None:
        key = os.environ.get("MINIPAGED_API_KEY") or None
    if key is not None and not key.strip():
        raise ValueError("--api-key is empty: give a key, or leave the flag out")
    return key


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (needs the serve extra)",
        description="Serve a model over the OpenAI API: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.",
    )
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    p.add_argument("--model", default=None, help="a GGUF file or a local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "float16", "half", "bfloat16"],
                   help="the weights' and activations' dtype (default auto: float32)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed the engine's random numbers, so unseeded sampled requests repeat from run to run (as vLLM's --seed)")
    p.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=False,
                   help="log every request's id, prompt size and sampling parameters (at info level)")
    p.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="do not log requests (the default; vLLM's older flag, accepted as is)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names clients may give as `model` (default: the model's name, and its Hub name for the default model)")
    p.add_argument("--trust-request-chat-template", action="store_true", default=False,
                   help="let chat requests bring their own Jinja chat_template (rendered sandboxed); without it they get "
                        "400, as in vLLM. chat_template_kwargs are always taken")
    p.add_argument("--return-tokens-as-token-ids", action="store_true", default=False,
                   help="logprobs name each token 'token_id:<id>' (a request's return_tokens_as_token_ids overrides it)")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only); 0.0.0.0 serves the network")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--max-waiting-requests", type=int, default=512, help="past this many waiting, new requests get 503 (default 512)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger bodies get 413 (default 1 MiB)")
    p.add_argument("--drain-timeout", type=float, default=10.0, help="on SIGTERM, seconds in-flight requests may finish before they are aborted")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--api-key", default=None,
                   help="clients must send 'Authorization: Bearer KEY' on /v1 routes (default: the MINIPAGED_API_KEY "
                        "environment variable; unset: no key). Set one whenever --host is not 127.0.0.1")
    _engine_flags(p)
    p.set_defaults(fn=run_serve)
    return p


def served_names(model: str | None, engine_model: Any) -> tuple[str, ...]:
    from ..model import DEFAULT_ALIASES, default_model_path, resolve_model_path

    def is_default() -> bool:
        try:
            return resolve_model_path(model).resolve() == default_model_path().resolve()
        except Exception:  # noqa: BLE001 - no default model installed: it is not the default
            return False

    if model is None or str(model) in DEFAULT_ALIASES or is_default():
        return ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "default")
    name = getattr(engine_model.config, "name", None) or str(model)
    return (str(name), str(model)) if str(name) != str(model) else (str(name),)


def build_app(args: argparse.Namespace):
    """Load the model (here) and return the app whose engine is built on the engine thread."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{SERVE_EXTRA_HINT} ({e})") from None
    import torch

    from ..config import split_kwargs
    from ..engine import LLMEngine
    from ..model import load_model
    from .app import ServerConfig, create_app

    kw = engine_kwargs(args)
    split_kwargs(kw)  # an invalid engine setting fails here, before the model loads
    api_key = api_key_of(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from ..dtypes import resolve_dtype

    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"two models given: {tag!r} and --model {args.model!r}; give one")
    args.model = args.model or tag
    model, tokenizer = load_model(args.model, dtype=resolve_dtype(getattr(args, "dtype", "auto")), device=device)
    names = tuple(args.served_model_name) if args.served_model_name else served_names(args.model, model)
    from .security import is_loopback

    cfg = ServerConfig(model_names=names, max_waiting_requests=args.max_waiting_requests,
                       max_request_bytes=args.max_request_bytes, drain_timeout_s=args.drain_timeout,
                       api_key=api_key, allowed_hosts="loopback" if is_loopback(args.host) else None,
                       log_requests=bool(getattr(args, "log_requests", False)),
                       trust_request_chat_template=bool(getattr(args, "trust_request_chat_template", False)),
                       return_tokens_as_token_ids=bool(getattr(args, "return_tokens_as_token_ids", False)))
    seed = getattr(args, "seed", None)

    def make_engine():
        if seed is not None:  # on the engine thread: unseeded requests draw their seeds from here
            torch.manual_seed(seed)
        return LLMEngine(model, tokenizer, **kw)

    return create_app(make_engine, cfg), cfg


def run_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError as e:  # name the extra, not just the missing module
        raise ImportError(f"{SERVE_EXTRA_HINT} ({e})") from None

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app, cfg = build_app(args)
    loop_ = app.state.engine_loop

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM / Ctrl-C: stop taking requests, let in-flight ones finish
            loop_.begin_shutdown(cfg.drain_timeout_s)
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            await super().shutdown(sockets)
            # uvicorn then re-raises the signal, so the exit status says SIGTERM, as supervisors expect
            state = "cleanly" if not loop_.alive and loop_.fatal_error is None else f"with an error: {loop_.fatal_error}"
            print(f"minipaged serve: stopped {state}", flush=True)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=int(cfg.drain_timeout_s) + 5, access_log=args.log_level in ("debug", "info"))
    server = _Server(config)
    print(f"minipaged serve: {cfg.model_names[0]} on http://{args.host}:{args.port}/v1 (Ctrl-C or SIGTERM stops it)", flush=True)
    if cfg.api_key is None and cfg.allowed_hosts is None:
        print(f"minipaged serve: warning: --host {args.host} serves other machines and no --api-key is set: "
              "anyone who reaches this port can use the model", flush=True)
    server.run()
    return 0 if not loop_.fatal_error else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m minipaged.server.cli serve ...`` without the main CLI."""
    ap = argparse.ArgumentParser(prog="minipaged")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_serve_parser(sub)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
