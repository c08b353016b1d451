"""vLLM's ten basic offline examples (basic, generate, chat, reproducibility, default sampling,
prefix caching, automatic prefix caching, the LLMEngine loop, structured outputs, n > 1), in
copies written in this project's words with only the import and the model changed
(tests/vllm_examples/), each run as a script."""
from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "vllm_examples"
EXAMPLES = ["basic", "generate", "chat", "reproducibility", "default_sampling", "prefix_caching",
            "automatic_prefix_caching", "llm_engine_example", "structured_outputs", "parallel_sampling"]


def run_example(name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(HERE / f"{name}.py"), run_name="__main__")
    return out.getvalue()


@pytest.fixture(autouse=True)
def _model_installed(smollm2_path):
    """The examples load SmolLM2 by its Hub name: skip where the model package is missing."""


def test_there_are_ten_examples():
    assert sorted(p.stem for p in HERE.glob("*.py")) == sorted(EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name):
    printed = run_example(name)
    assert printed.strip(), f"{name} printed nothing"
    if name == "reproducibility":  # the same seed, the same text and the same random number
        assert run_example(name) == printed
    if name == "prefix_caching":
        assert "same answers: True" in printed
    if name == "llm_engine_example":
        assert len(printed.strip().splitlines()) == 3
    if name == "structured_outputs":
        lines = [eval(line) for line in printed.strip().splitlines()]  # the reprs it printed
        assert lines[0] in ("Positive", "Negative")
        # the whole address, or (cut by max_tokens) a start of one: the regex never lets anything else out
        assert re.fullmatch(r"\w+(@\w*(\.(c(om?)?)?)?)?", lines[1])
        car = json.loads(lines[2])
        assert set(car) == {"brand", "model", "kind"} and car["kind"] in ("sedan", "SUV", "Truck")
        assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", lines[3])
