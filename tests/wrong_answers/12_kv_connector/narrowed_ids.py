"""The solved connector, but _hashes first stores the token ids in 16 bits (a uint16 array, "to save memory"): id
70,000 becomes 4,464, so a prompt's blocks hash like another prompt's, and the host tier loads K/V that belong to
other tokens."""
CHECK = "minipaged.checks.kv_connector:check_connector"
import sys
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = ["16-bit aliases", "narrowed to 16 bits"]


def answer():
    ns = _plant.solved("12_kv_connector")
    full_block_hashes = ns["full_block_hashes"]

    class MyHostConnector(ns["MyHostConnector"]):
        def _hashes(self, seq):
            ids = array("H", [t & 0xFFFF for t in seq.token_ids]).tolist()
            return full_block_hashes(ids, self.block_size, self.hashes.setdefault(seq.seq_id, []))

    return (MyHostConnector,)
