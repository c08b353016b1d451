"""The solved int8 part of workbook 04 (its code cells run), for the int8 wrong answers to break one rule each."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

SOLVED = _plant.solved("04_paged_attention_torch")
QMAX = 127
