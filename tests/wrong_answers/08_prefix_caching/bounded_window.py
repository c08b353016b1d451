"""The solved prefix cache, but match_prefix and cache_blocks look only at the last 1,024 token ids ("no
prompt is longer than that"): a prompt as long as max_model_len is hashed from the wrong start, so nothing of it
is ever found again."""
CHECK = "minipaged.checks.prefix_cache:check_lookup_and_eviction"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["num_cached_blocks differs", "only part of a long prompt"]
HINT = "only part of a long prompt"


def answer():
    return (_plant.subclass_with(_plant.subclass_with(_plant.solved('08_prefix_caching')['MyPrefixCache'], 'match_prefix', _plant.windowed, 'token_ids'), 'cache_blocks', _plant.windowed, 'token_ids'),)
