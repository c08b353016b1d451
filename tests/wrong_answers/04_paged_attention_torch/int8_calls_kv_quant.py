"""int8 quantize that hands the work to minipaged's own kv_quant.quantize from inside: delegation, refused."""
CHECK = "minipaged.checks.kv_int8:check_quantize"
EXPECT = ["called minipaged.kv_quant.quantize", "minipaged's own implementation"]

from minipaged import kv_quant

from _int8 import SOLVED


def quantize(x, scales):
    return kv_quant.quantize(x, scales[:, None, :, None], kv_quant.FORMATS["int8"])


def answer():
    return SOLVED["block_scales"], quantize, SOLVED["dequantize"]
