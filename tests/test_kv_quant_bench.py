"""`minipaged bench kvquant`'s parts: the held-out text ships, the teacher-forced pass reads the
pages it wrote, the table and the README section. (Its figures are measured, not asserted.)"""
from __future__ import annotations

import pytest
import torch

from minipaged.bench import kvquant as bk


def test_the_heldout_text_ships_with_the_package():
    text = bk.heldout_text()
    assert len(text.split()) > 200


def test_teacher_forced_logits_auto_equal_the_models_own_and_8_bit_ones_differ(tiny_model):
    model, tok = tiny_model
    ids = tok.encode(bk.heldout_text())[:40]
    from minipaged.attention import AttentionMetadata

    cache = model.new_kv_cache(3, 16)
    meta = AttentionMetadata(torch.arange(40), torch.arange(3, dtype=torch.int32)[None],
                             torch.tensor([40], dtype=torch.int32), torch.tensor([0, 40], dtype=torch.int32))
    want = model.compute_logits(model(torch.tensor(ids), torch.arange(40), cache, meta))
    torch.testing.assert_close(bk.teacher_forced_logits(model, ids, "auto"), want)
    for name in ("int8", "fp8_e5m2"):
        got = bk.teacher_forced_logits(model, ids, name)
        assert torch.isfinite(got).all() and not torch.equal(got, want)


def fake_result():
    d = {"greedy_agreement": 1.0, "mean_kl": 0.0, "perplexity": 10.0, "batch_1_tok_s": 50.0, "batch_8_tok_s": 200.0,
         "kv_bytes_per_token": 46080, "max_batch_in_budget": 1}
    return {"model": "m", "max_tokens": 16, "prompts": ["a"], "budget_mib": 64, "seq_len": 1024, "batch": 8,
            "threads": 1, "dtypes": {"auto": d, "int8": {**d, "perplexity": 10.5, "kv_bytes_per_token": 11520,
                                                          "max_batch_in_budget": 5}}}


def test_the_table_and_the_readme_section(tmp_path):
    table = bk.format_table(fake_result())
    assert "| int8 | 11,520 | 5 | 100.0% | 0.0000 | 10.50 (+0.50) | 50.0 | 200.0 |" in table
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{bk.README_START}\nold\n{bk.README_END}\nrest\n", encoding="utf-8")
    assert bk.update_readme(fake_result(), str(readme))
    text = readme.read_text(encoding="utf-8")
    assert "old" not in text and table in text and text.endswith("rest\n")
    (tmp_path / "R2.md").write_text("no markers", encoding="utf-8")
    assert not bk.update_readme(fake_result(), str(tmp_path / "R2.md"))


def test_the_command_is_in_the_bench_menu():
    from minipaged.bench.commands import BENCH_COMMANDS

    assert "kvquant" in [name for name, _, _ in BENCH_COMMANDS]
    pytest.importorskip("matplotlib")
