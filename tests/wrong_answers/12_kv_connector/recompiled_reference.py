"""minipaged's own minipaged.kv_connector.HostOffloadConnector, its module's source compiled again from a file of the learner's:
the same bytecode, names and constants under another file name, refused as minipaged's."""
CHECK = "minipaged.checks.kv_connector:check_connector"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = _plant.COPY_EXPECT


def answer():
    return (_plant.recompiled('minipaged.kv_connector', 'HostOffloadConnector'),)
