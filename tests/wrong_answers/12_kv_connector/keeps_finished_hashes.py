"""request_finished forgets nothing: a request id that comes back with other tokens is matched by its old hashes."""
CHECK = "minipaged.checks.kv_connector:check_connector"
EXPECT = ["returned another count"]

from _base import GoodConnector


class MyHostConnector(GoodConnector):
    def request_finished(self, seq):
        pass
