"""int8 quantize without the clip: values beyond 127 * scale wrap around in .to(torch.int8)."""
CHECK = "minipaged.checks.kv_int8:check_quantize"
EXPECT = ["given scales of 0.05", "wrapped around", "clamp(-127, 127)"]

import torch

from _int8 import SOLVED


def quantize(x, scales):
    s = scales[:, None, :, None]
    y = torch.where(s > 0, x.float() / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
    return y.round().to(torch.int32).to(torch.int8)


def answer():
    return SOLVED["block_scales"], quantize, SOLVED["dequantize"]
