"""scripts/gpu_check.sh, the one command to run when a GPU is available: what it covers, its
8-minute budget, and its JSON summary (here, without a GPU: it stops, saying so)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
GPU_BRANCH = re.compile(r"torch\.cuda\.|HAVE_TRITON|device=\"cuda\"|\.cuda\(\)")


def _gpu_lessons() -> dict[str, int]:
    line = next(ln for ln in SCRIPT.read_text().splitlines() if ln.startswith("GPU_LESSONS="))
    return {spec.split(":")[0]: int(spec.split(":")[1]) for spec in line.split("=", 1)[1].strip('"').split()}


def test_every_lesson_with_a_gpu_path_is_run():
    listed = _gpu_lessons()
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        code = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
        if GPU_BRANCH.search(code):
            assert path.stem in listed, f"{path.name} takes a GPU branch: add it to GPU_LESSONS in scripts/gpu_check.sh"
    assert all((ROOT / "notebooks" / f"{n}.ipynb").is_file() for n in listed)


def test_the_step_limits_fit_in_eight_minutes():
    text = SCRIPT.read_text()
    fixed = sum(int(m) for m in re.findall(r"^step \w+ (\d+) ", text, flags=re.M))
    assert "minipaged.bench kernels" in text and "tests/test_triton_attention.py" in text
    assert fixed + sum(_gpu_lessons().values()) <= 480
    assert "BUDGET_S=480" in text


@pytest.mark.slow  # imports torch in a fresh process
def test_without_a_gpu_it_stops_and_writes_a_summary(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    env = {**os.environ, "PYTHON": str(Path(os.sys.executable))}
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr, r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpu"] is None and summary["steps"] == {} and "nothing was measured" in summary["reason"]
