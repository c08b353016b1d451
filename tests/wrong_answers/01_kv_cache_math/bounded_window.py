"""The solved bytes_per_sequence, but it caps the length at 1,024 tokens ("no prompt is longer than that"):
a sequence as long as the model's max_model_len is priced as 1,024 tokens."""
CHECK = "minipaged.checks.kv_cache_math:check_bytes_per_sequence"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["num_tokens=8192", "caps the length"]


def answer():
    return (_plant.windowed(_plant.solved('01_kv_cache_math')['bytes_per_sequence'], 'num_tokens'),)
