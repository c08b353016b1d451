"""int8 quantize that divides by an all-zero head's scale of 0: 0 / 0 is NaN (stored as 0 here only by luck)."""
CHECK = "minipaged.checks.kv_int8:check_quantize"
EXPECT = ["made a nan", "block 1 all zeros", "divided by a scale of 0"]

import torch

from _int8 import QMAX, SOLVED


def quantize(x, scales):
    return (x.float() / scales[:, None, :, None]).round().clamp(-QMAX, QMAX).to(torch.int8)


def answer():
    return SOLVED["block_scales"], quantize, SOLVED["dequantize"]
