"""tp_step_time sends the whole payload once, without the ring's 2 (n - 1) / n."""
CHECK = "minipaged.checks.predict:check_tensor_parallel"
EXPECT = ["tp_step_time", "2 (n - 1) / n"]
from _base import all_reduce_bytes_per_token, tp_step_time


def tp(step_s, n, num_layers, hidden_size, dtype_bytes, batch, link_GBps, latency_s):
    return step_s / n + 2 * num_layers * (latency_s + batch * hidden_size * dtype_bytes / (link_GBps * 1e9))


def answer():
    return all_reduce_bytes_per_token, tp
