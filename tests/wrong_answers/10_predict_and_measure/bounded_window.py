"""The solved kv_capacity, but it caps the sequence length at 1,024 tokens: sequences as long as the
model's context take more blocks than it counts."""
CHECK = "minipaged.checks.predict:check_kv_capacity"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["num_tokens=2048", "caps the length"]


def answer():
    return (_plant.windowed(_plant.solved('10_predict_and_measure')['kv_capacity'], 'num_tokens'),)
