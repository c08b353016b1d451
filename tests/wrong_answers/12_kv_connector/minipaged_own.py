"""The learner hands in minipaged's own HostOffloadConnector: the check must not grade the reference."""
CHECK = "minipaged.checks.kv_connector:check_connector"
EXPECT = ["minipaged's own", "write your own"]

from minipaged.kv_connector import HostOffloadConnector


class MyHostConnector(HostOffloadConnector):
    pass
