"""The paper's §6.3-6.5 on the simulated GPU (minipaged/bench/gpu/sharing.py): the sharing-saving
arithmetic on a hand-built case, the experiments at a small scale, and their bad input."""
import json

import pytest

from minipaged.beam_search import SharingCounter, sharing_saving
from minipaged.block_allocator import BlockAllocator
from minipaged.block_table import BlockTable
from minipaged.bench.gpu.simulator import Setting
from minipaged.bench.gpu.sharing import (PREFIX_TOKENS, capacity, format_table, readme_rows, reproduce_sharing,
                                         simulate, workloads, Workload)
from minipaged.parts import fork_table
from minipaged.prefix_cache import copy_on_write


def test_the_sharing_saving_is_blocks_saved_over_blocks_needed_without_sharing_on_a_hand_built_fork():
    pool = BlockAllocator(16, 4)
    parent = BlockTable(pool)
    parent.append_tokens(10)  # 3 blocks: two full, the last holding 2 of 4
    child = fork_table(parent)  # shares all three
    assert child.blocks == parent.blocks and all(pool.ref_count(b) == 2 for b in parent.blocks)
    # the child writes its 11th token: only the last, partial block is copied
    copies = copy_on_write(child, 10, 11)
    child.append_tokens(1)
    assert len(copies) == 1 and child.blocks[:2] == parent.blocks[:2] and child.blocks[2] != parent.blocks[2]
    logical, physical, saving = sharing_saving([parent.blocks, child.blocks])
    # without sharing: 3 + 3 = 6 blocks; held: the 2 shared + 2 last blocks = 4; saved 2 of 6
    assert (logical, physical) == (6, 4) and saving == pytest.approx(2 / 6)
    # a third table of its own shares nothing: 6 + 2 needed, 4 + 2 held
    other = BlockTable(pool)
    other.append_tokens(5)
    assert sharing_saving([parent.blocks, child.blocks, other.blocks]) == (8, 6, pytest.approx(2 / 8))
    # over steps, each step weighs the same: (2 + 0) saved over (6 + 2) needed
    c = SharingCounter()
    c.add([parent.blocks, child.blocks])
    c.add([other.blocks])
    assert c.as_dict() == {"logical_blocks": 8, "physical_blocks": 6, "saving": pytest.approx(2 / 8)}
    assert sharing_saving([]) == (0, 0, 0.0)


def test_the_simulated_vllm_measures_sharing_and_the_orca_baselines_share_nothing():
    st = Setting(dataset="alpaca")
    r, sh = simulate(st, Workload("parallel", 3), "vllm", 1e9, 12, 5)
    assert r.rejected == 0 and 0 < sh["physical_blocks"] < sh["logical_blocks"]
    # n = 1: one sequence a request, nothing to share
    r1, sh1 = simulate(st, Workload("basic", 1), "vllm", 1e9, 12, 5)
    assert sh1["logical_blocks"] == sh1["physical_blocks"] > 0
    # a baseline serves n sequences a request, each with its own prompt: n times the prompt tokens computed
    ro, sho = simulate(st, Workload("parallel", 3), "orca_oracle", 1e9, 12, 5)
    assert sho == {} and ro.rejected == 0
    # beams share more than parallel samples (they fork every step and share their common past)
    _, shb = simulate(st, Workload("beam", 3), "vllm", 1e9, 12, 5)
    assert shb["saving"] > sh["saving"] > 0


def test_capacity_reads_the_completion_rate_with_the_queue_full_and_refuses_too_few():
    class R:
        finish_times = [float(i) for i in range(1, 11)] + [float("nan")]

    # of 10 finished: the 2nd (t=3) to the 7th (t=8): 5 requests in 5 s
    assert capacity(R()) == pytest.approx(1.0)
    R.finish_times = [1.0]
    with pytest.raises(ValueError, match="too few"):
        capacity(R())


@pytest.fixture(scope="module")
def small():
    return {
        "beam": reproduce_sharing("beam", [2, 4], num_requests=40, workers=1),
        "parallel": reproduce_sharing("parallel", [1, 4], num_requests=40, workers=1),
        "prefix": reproduce_sharing("prefix", ["one-shot", "five-shot"], num_requests=40, workers=1),
        "chatbot": reproduce_sharing("chatbot", ["chatbot"], num_requests=30, workers=1),
    }


def test_the_bench_runs_every_experiment_at_a_small_scale_on_the_papers_settings(small):
    assert small["prefix"]["settings"]["model"] == "llama-13b" and small["prefix"]["settings"]["dataset"] == "wmt16"
    assert small["beam"]["settings"]["model"] == "opt-13b" and small["beam"]["settings"]["dataset"] == "alpaca"
    assert small["chatbot"]["settings"]["dataset"] == "chatbot"
    for res in small.values():
        for run in res["runs"]:
            assert set(run["systems"]) == {"orca_max", "orca_pow2", "orca_oracle", "vllm"}
            assert all(e["max_rate"] > 0 and e["rejected"] == 0 for e in run["systems"].values())
            # paging never serves fewer requests a second than reserving the most (same trace, same clock)
            assert run["gains"]["vllm_over_orca_max"] > 1
            assert 0 <= run["memory_saved"] < 1
    beam, par = small["beam"]["runs"], small["parallel"]["runs"]
    assert par[0]["kind"] == "basic" and par[0]["memory_saved"] == 0  # n = 1 shares nothing
    assert beam[1]["memory_saved"] > beam[0]["memory_saved"] > par[1]["memory_saved"] > 0  # wider beams share more
    pre = small["prefix"]["runs"]
    assert [r["prefix_tokens"] for r in pre] == [PREFIX_TOKENS["one-shot"], PREFIX_TOKENS["five-shot"]]
    assert pre[1]["memory_saved"] > pre[0]["memory_saved"] > 0  # the longer shared prefix saves more
    assert pre[1]["gains"]["vllm_over_orca_oracle"] > pre[0]["gains"]["vllm_over_orca_oracle"]
    assert small["chatbot"]["runs"][0]["memory_saved"] == 0  # a chatbot's prompts share nothing
    # the tables read the result, with the paper's numbers beside it
    rows = readme_rows(list(small.values()))
    assert len(rows) == 7 and any("3.58x" in r for r in rows) and any("37.6-55.2%" in r for r in rows)
    assert "beam search, width 4" in format_table(small["beam"])


def test_the_simulated_gpu_is_deterministic():
    a = reproduce_sharing("beam", [2], num_requests=20, systems=["orca_oracle", "vllm"], workers=1)
    b = reproduce_sharing("beam", [2], num_requests=20, systems=["orca_oracle", "vllm"], workers=1)
    assert a["runs"] == b["runs"]


def test_the_cli_runs_a_sharing_experiment_and_stores_it(tmp_path, capsys):
    from minipaged.cli import main

    out = tmp_path / "par.json"
    main(["bench", "paper", "--parallel-samples", "2", "--num-requests", "20", "--systems", "orca_oracle,vllm",
          "--workers", "1", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["experiment"] == "parallel" and res["runs"][0]["width"] == 2
    assert res["arguments"]["parallel_samples"] == [2]
    assert "parallel sampling, n=2" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [
    (["--beam-width", "0"], "numbers >= 1"),
    (["--parallel-samples", "two"], "whole numbers"),
    (["--shared-prefix", "ten-shot"], "one-shot, five-shot"),
])
def test_bad_sharing_flags_say_what_to_give(args, says, capsys):
    from minipaged.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "paper", *args])
    assert says in capsys.readouterr().err


def test_two_experiments_at_once_and_bad_values_are_refused():
    from minipaged.cli import main

    with pytest.raises(SystemExit, match="one of"):
        main(["bench", "paper", "--beam-width", "2", "--chatbot"])
    with pytest.raises(ValueError, match="one-shot"):
        workloads("prefix", ["two-shot"])
    with pytest.raises(ValueError, match="max_num_seqs"):
        reproduce_sharing("beam", [300], num_requests=20)
    with pytest.raises(ValueError, match="unknown experiment"):
        reproduce_sharing("speculative", [2])
    with pytest.raises(ValueError, match="fastertransformer"):
        reproduce_sharing("beam", [2], systems=["fastertransformer"])


def test_the_readme_sharing_table_is_the_stored_runs_and_its_prose_quotes_them():
    from pathlib import Path

    from minipaged.bench.gpu.sharing import MARKERS, STORED, readme_block

    root = Path(__file__).resolve().parents[1]
    runs = [json.loads((root / "docs" / "figures" / f"paper_sharing_{k}.json").read_text()) for k in STORED]
    for res, k in zip(runs, STORED):
        assert res["experiment"] == k and "arguments" in res  # written by the bench's save_run
    readme = (root / "README.md").read_text(encoding="utf-8")
    b, e = MARKERS
    assert readme.split(b, 1)[1].split(e, 1)[0].strip() == readme_block(runs).strip(), (
        "the README's sharing table is not the stored runs: rerun the bench with --readme README.md")
    chat = runs[3]["runs"][0]["systems"]
    assert chat["vllm"]["preemptions"] == 248 and "248 times" in readme
    assert all(0.50 <= chat[s]["max_rate"] <= 0.53 for s in ("orca_max", "orca_pow2", "orca_oracle"))
