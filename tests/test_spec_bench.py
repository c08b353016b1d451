"""`minipaged bench spec --quick` on the real default model: it runs, writes the JSON the README's
spec block reads, and speculation left every greedy token as it was. No timing is asserted here:
speeds belong to the bench's own run (docs/figures/spec.json), not to tests."""
from __future__ import annotations

import json

import pytest


def test_repeat_texts_come_from_the_package_and_cycle():
    from minipaged.bench.spec import repeat_texts

    texts = repeat_texts(40, max_chars=200)
    assert len(texts) == 40 and {k for k, _ in texts} == {"code", "text"}
    assert all(0 < len(t) <= 200 for _, t in texts)
    assert any(t.startswith("def verify_run") for _, t in texts)
    assert texts == repeat_texts(40, max_chars=200), "the workload must be the same every run"


def test_quick_run_writes_the_json_with_greedy_tokens_equal(tmp_path, smollm2_path, capsys):
    from minipaged.cli import main

    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in ("rows", "greedy_equal", "goals", "speculative_config", "plan", "route", "max_tokens", "batch_size",
                "workloads", "machine", "arguments"):
        assert key in res, key
    assert res["greedy_equal"] is True
    assert {(r["workload"], r["batch"]) for r in res["rows"]} == {("repeat", 1), ("repeat", res["batch_size"]),
                                                                    ("chat", 1), ("chat", res["batch_size"])}
    for r in res["rows"]:
        assert r["greedy_equal"] is True
        assert r["off_tokens_per_s"] > 0 and r["on_tokens_per_s"] > 0 and r["speedup"] > 0
        for key in ("acceptance_rate", "mean_accepted_length", "routes_on", "routes_off", "num_drafts"):
            assert key in r, key
    rep = [r for r in res["rows"] if r["workload"] == "repeat"]
    assert all(r["num_drafts"] > 0 for r in rep), "the repeat workload verified no draft"
    assert "speculative" in res["plan"]["routes"] and "verifying steps" in res["route"]
    assert set(res["goals"]) == {"repeat_batch1_speedup", "chat_batch1_speedup"}
    text = capsys.readouterr().out
    assert "greedy_equal: True" in text and "route:" in text and "| workload | batch |" in text
