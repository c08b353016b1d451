"""minipaged's own int8 dequantize (minipaged.kv_quant.dequantize) passed as the learner's: refused before it runs."""
CHECK = "minipaged.checks.kv_int8:check_quantize"
EXPECT = ["dequantize is minipaged's own minipaged.kv_quant.dequantize"]

from minipaged import kv_quant

from _int8 import SOLVED


def answer():
    return SOLVED["block_scales"], SOLVED["quantize"], kv_quant.dequantize
