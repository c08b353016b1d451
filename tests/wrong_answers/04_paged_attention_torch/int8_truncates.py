"""int8 quantize that truncates toward zero (.to(torch.int8) alone) instead of rounding to the nearest."""
CHECK = "minipaged.checks.kv_int8:check_quantize"
EXPECT = ["differs from minipaged's int8 pages", "truncated toward zero", "round to the nearest"]

import torch

from _int8 import QMAX, SOLVED


def quantize(x, scales):
    s = scales[:, None, :, None]
    y = torch.where(s > 0, x.float() / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
    return y.clamp(-QMAX, QMAX).to(torch.int8)


def answer():
    return SOLVED["block_scales"], quantize, SOLVED["dequantize"]
