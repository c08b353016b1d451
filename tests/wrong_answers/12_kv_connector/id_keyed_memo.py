"""The solved connector, but _hashes keeps its answer by id(seq): a finished request's Sequence handed in
again with other tokens gets the hashes of its old ones."""
CHECK = "minipaged.checks.kv_connector:check_connector"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["changed in place", "seq.seq_id"]


def answer():
    return (_plant.subclass_with(_plant.solved('12_kv_connector')['MyHostConnector'], '_hashes', _plant.memo_by_id),)
