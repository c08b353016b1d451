"""The solved choice_mask, but it first stores the stop token ids in 16 bits: Qwen2.5's stop tokens
151,643 and 151,645 become 20,571 and 20,573, ordinary tokens, which the mask then allows."""
CHECK = "minipaged.checks.structured:check_choice_mask"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["151643", "past 16 bits"]


def answer():
    return (_plant.narrowed(_plant.solved('11_structured_outputs')['choice_mask'], 'stop_token_ids'),)
