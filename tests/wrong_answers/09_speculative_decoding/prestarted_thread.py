"""The solved propose_ngram, with a thread of the learner's started before the check and still running (a worker
that could run minipaged's reference out of the watch's sight): refused, saying why."""
CHECK = "minipaged.checks.spec_decode:check_proposer"
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _plant  # noqa: E402

EXPECT = _plant.THREAD_EXPECT
HINT = None  # a refusal: the message says what to do, with no hint
_WORKER = _plant.PreStarted()


def answer():
    _WORKER.start()
    return (_plant.solved('09_speculative_decoding')['propose_ngram'],)


def teardown():
    _WORKER.stop()
