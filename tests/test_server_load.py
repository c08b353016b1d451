"""Load and faults on a real `minipaged serve` process, on 127.0.0.1, bounded in count and time.

A tiny random-weight Llama (tests/conftest.py) keeps 200 clients fast; what is tested is the
server and the engine loop, not the model: every client completes with every token it asked
for, none is lost, every KV block is free at the end, resident memory stays bounded, clients
that hang up are aborted without touching the others, a client that reads nothing does not
stall the engine, overload is a 503, and SIGTERM lets in-flight requests end cleanly.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")  # builds the tiny model

from minipaged.server.launch import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def long_tiny_dir(tmp_path_factory):
    """The tiny random Llama with a 2048-token context, so one request can run for seconds."""
    from conftest import build_tiny_tokenizer, tiny_hf_model

    folder = tmp_path_factory.mktemp("tiny_long")
    model = tiny_hf_model("llama", vocab_size=512)
    model.config.max_position_embeddings = 2048
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(long_tiny_dir):
    # 256 blocks of 16 slots: 64 running sequences of up to 30 tokens fit (2 blocks each) many times over.
    # The 2048-token context lets a client that hangs up ask for HANG_UP_TOKENS (a max_tokens past the
    # context is a 400 before any work, as in vLLM).
    with ServerProcess(long_tiny_dir, env=ENV, max_num_seqs=64, num_blocks=256, max_waiting_requests=1000,
                       attention="torch") as srv:
        yield srv


# A client that hangs up asks for this many tokens: far more than the engine makes before the
# server sees the closed connection, however fast the engine and however busy the event loop (at
# 100 tokens, a fast engine finished some of them while their first chunk was still on its way).
HANG_UP_TOKENS = 2000


def _body(i: int, max_tokens: int = MAX_TOKENS) -> dict:
    return {"prompt": [3 + (i * 7 + k) % 500 for k in range(4 + i % 13)], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


async def _stream(client: httpx.AsyncClient, url: str, body: dict, hang_up_after: int | None = None) -> dict:
    """One streaming request; returns what arrived. ``hang_up_after``: close after that many chunks."""
    got = {"chunks": 0, "text": "", "done": False, "finish": None, "status": None, "error": None}
    async with client.stream("POST", url + "/completions", json=body) as r:
        got["status"] = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                got["done"] = True
                break
            msg = json.loads(line[6:])
            if "error" in msg:
                got["error"] = msg["error"]
                continue
            ch = msg["choices"][0]
            got["chunks"] += 1
            got["text"] += ch["text"]
            got["finish"] = ch["finish_reason"] or got["finish"]
            if hang_up_after is not None and got["chunks"] >= hang_up_after:
                return got  # leaving the block closes the connection mid-stream
    return got


async def _many(url: str, n: int, hang_up: set[int] = frozenset(), max_tokens: int = MAX_TOKENS) -> list[dict]:
    """``n`` streams at once; those in ``hang_up`` ask for 100 tokens and hang up after the first."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*[
            _stream(client, url, _body(i, HANG_UP_TOKENS), 1) if i in hang_up else _stream(client, url, _body(i, max_tokens))
            for i in range(n)])


def _wait_idle(server: ServerProcess, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m["minipaged:num_requests_running"] == 0 and m["minipaged:num_requests_waiting"] == 0 and m["minipaged:num_kv_blocks_used"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not go idle within {timeout_s} s: {m}")
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_200_concurrent_streams_all_complete_blocks_free_rss_bounded(server):
    before = _wait_idle(server)
    first = asyncio.run(_many(server.url, 200))  # warms up allocator, tokenizer, sockets
    rss_warm = server.rss_mib()
    second = asyncio.run(_many(server.url, 200))
    rss_after = server.rss_mib()
    for round_ in (first, second):
        lost = [i for i, g in enumerate(round_) if not (g["status"] == 200 and g["done"] and g["finish"] == "length")]
        assert not lost, f"{len(lost)} of 200 streams did not complete: first {round_[lost[0]]}"
    m = _wait_idle(server)
    done = m["minipaged:request_success_total"] - before.get("minipaged:request_success_total", 0)
    assert done == 400, f"the server finished {done} requests, 400 were sent"
    tokens = m["minipaged:generation_tokens_total"] - before.get("minipaged:generation_tokens_total", 0)
    assert tokens == 400 * MAX_TOKENS
    assert m["minipaged:num_kv_blocks_used"] == 0, "KV blocks leaked"
    # A second round of the same load must not keep the first round's requests (no per-request leak).
    assert rss_after - rss_warm < 40, f"RSS grew by {rss_after - rss_warm:.0f} MiB over 200 more requests (warm {rss_warm:.0f} MiB)"


@pytest.mark.timeout(300)
def test_clients_that_hang_up_mid_stream_are_aborted_and_the_others_unaffected(server):
    before = _wait_idle(server)
    hang = set(range(0, 100, 10))  # 10% of 100 clients
    got = asyncio.run(_many(server.url, 100, hang_up=hang, max_tokens=40))
    for i, g in enumerate(got):
        if i in hang:
            assert g["chunks"] == 1 and not g["done"]
        else:
            assert g["done"] and g["finish"] == "length", f"client {i} was affected by others hanging up: {g}"
    m = _wait_idle(server)
    aborted = m["minipaged:request_aborted_total"] - before.get("minipaged:request_aborted_total", 0)
    finished = m["minipaged:request_success_total"] - before.get("minipaged:request_success_total", 0)
    assert aborted == len(hang) and finished == 100 - len(hang), f"aborted {aborted}, finished {finished}"
    assert m["minipaged:num_kv_blocks_used"] == 0


@pytest.mark.timeout(300)
def test_a_client_that_reads_nothing_does_not_stall_the_engine(server):
    before = _wait_idle(server)
    body = json.dumps(_body(0, max_tokens=100)).encode()
    s = socket.create_connection((server.host, server.port))
    try:  # a raw client: sends its request, then never reads a byte
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        t = time.monotonic()
        got = asyncio.run(_many(server.url, 20))
        took = time.monotonic() - t
        assert all(g["done"] for g in got), "requests beside the silent client did not complete"
        # The silent client's own request ran to its end on the engine side too: the engine never waited for it.
        deadline = time.monotonic() + 60
        while server.metrics()["minipaged:request_success_total"] - before.get("minipaged:request_success_total", 0) < 21:
            assert time.monotonic() < deadline, "the silent client's request did not finish in the engine"
            time.sleep(0.1)
        assert took < 60
    finally:
        s.close()
    _wait_idle(server)


@pytest.mark.timeout(480)
def test_overload_is_503_and_sigterm_lets_in_flight_requests_finish(long_tiny_dir):
    srv = ServerProcess(long_tiny_dir, env=ENV, max_num_seqs=1, num_blocks=128, max_waiting_requests=2, attention="torch",
                        drain_timeout=60)
    with srv:
        async def go():
            async with httpx.AsyncClient(timeout=120) as client:
                deadline = time.monotonic() + 240  # generous: a busy CI machine can be many times slower

                async def until(name: str, at_least: int) -> None:
                    while (await asyncio.to_thread(srv.metrics))[name] < at_least:
                        assert time.monotonic() < deadline, (srv.metrics(), [t.done() and t.result() for t in long])
                        await asyncio.sleep(0.02)

                # One at a time: sent together, the third can reach the server while the first is still
                # waiting to be admitted (two waiting already), and is rightly refused with a 503.
                # the first runs long enough that the other two are still waiting when the 503 is tested
                long = [asyncio.ensure_future(_stream(client, srv.url, _body(0, max_tokens=1000)))]
                await until("minipaged:num_requests_running", 1)
                long.append(asyncio.ensure_future(_stream(client, srv.url, _body(1, max_tokens=300))))
                await until("minipaged:num_requests_waiting", 1)
                long.append(asyncio.ensure_future(_stream(client, srv.url, _body(2, max_tokens=300))))
                await until("minipaged:num_requests_waiting", 2)  # one runs, two wait: the limit
                r = await client.post(srv.url + "/completions", json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded", r.text
                assert r.headers.get("retry-after") == "1"
                os.kill(srv.pid, 15)  # SIGTERM while three requests are in flight
                await asyncio.sleep(1.0)
                try:  # during the drain a new request is refused: no connection, or a 503 that says why
                    r = await client.post(srv.url + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
                    assert r.status_code == 503 and "shutting down" in r.text, r.text
                except httpx.HTTPError:
                    pass
                done = await asyncio.gather(*long)
                assert all(d["done"] and d["finish"] == "length" and d["chunks"] > 1 for d in done), done
                return done

        asyncio.run(go())
        code = srv.proc.wait(60)
        assert code in (0, -15) and "stopped cleanly" in srv.tail(), srv.tail()
    m_text = srv.tail()
    assert "Traceback" not in m_text, m_text


@pytest.mark.timeout(120)
def test_sigterm_aborts_what_cannot_finish_within_the_drain_timeout(long_tiny_dir):
    srv = ServerProcess(long_tiny_dir, env=ENV, max_num_seqs=1, num_blocks=128, attention="torch", drain_timeout=0.5)
    with srv:
        async def go():
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [asyncio.ensure_future(_stream(client, srv.url, _body(i, max_tokens=1500))) for i in range(4)]
                await asyncio.sleep(0.5)
                os.kill(srv.pid, 15)
                return await asyncio.gather(*tasks, return_exceptions=True)

        got = asyncio.run(go())
        assert srv.proc.wait(60) in (0, -15) and "stopped cleanly" in srv.tail(), srv.tail()
    # Every client got an answer that ends: its tokens, or an error that says the server shut down
    # (a 503 before the first token, or an error event and [DONE] in the stream).
    assert all(isinstance(g, dict) for g in got), got
    finished = [g for g in got if g["finish"] == "length" and g["done"]]
    cut = [g for g in got if g["status"] == 503 or (g["done"] and g["error"] and "shut down" in g["error"]["message"])]
    assert len(finished) + len(cut) == len(got) and cut, got
