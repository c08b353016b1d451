"""The solved MyHostConnector.save_kv, but it first calls a check's own helper (minipaged.checks._core.plain), package code
the workbook does not hand over: the watch allows, it does not deny, so it is refused."""
CHECK = "minipaged.checks.kv_connector:check_connector"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = _plant.UNLISTED_EXPECT


def answer():
    return (_plant.with_unlisted_call(_plant.solved('12_kv_connector')['MyHostConnector'], 'save_kv'),)
