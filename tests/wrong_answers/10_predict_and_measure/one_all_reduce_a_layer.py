"""all_reduce_bytes_per_token counts one all-reduce a layer."""
CHECK = "minipaged.checks.predict:check_tensor_parallel"
EXPECT = ["all_reduce_bytes_per_token", "two all-reduces per layer"]
from _base import all_reduce_bytes_per_token, tp_step_time


def answer():
    return (lambda L, H, d: L * H * d), tp_step_time
