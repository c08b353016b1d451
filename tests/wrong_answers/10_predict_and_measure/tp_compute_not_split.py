"""tp_step_time keeps the whole step's compute on every rank."""
CHECK = "minipaged.checks.predict:check_tensor_parallel"
EXPECT = ["tp_step_time", "1/n of the step"]
from _base import all_reduce_bytes_per_token, tp_step_time


def tp(step_s, n, num_layers, hidden_size, dtype_bytes, batch, link_GBps, latency_s):
    ring = 2 * (n - 1) / n * batch * hidden_size * dtype_bytes
    return step_s + 2 * num_layers * (latency_s + ring / (link_GBps * 1e9))


def answer():
    return all_reduce_bytes_per_token, tp
