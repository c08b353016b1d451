"""The solved gather_kv, but it gathers at most 1,024 tokens ("no context is longer than that"):
a context of 2,048 tokens loses its first half."""
CHECK = "minipaged.checks.paged_attention:check_gather_kv"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["has the wrong shape", "caps the length"]


def answer():
    return (_plant.windowed(_plant.solved('04_paged_attention_torch')['gather_kv'], 'context_len'),)
