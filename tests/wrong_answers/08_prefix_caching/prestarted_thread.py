"""The solved copy_on_write, with a thread of the learner's started before the check and still running (a worker
that could run minipaged's reference out of the watch's sight): refused, saying why."""
CHECK = "minipaged.checks.prefix_cache:check_copy_on_write"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = _plant.THREAD_EXPECT
HINT = None  # a refusal: the message says what to do, with no hint
_WORKER = _plant.PreStarted()


def answer():
    _WORKER.start()
    return (_plant.solved('08_prefix_caching')['copy_on_write'],)


def teardown():
    _WORKER.stop()
