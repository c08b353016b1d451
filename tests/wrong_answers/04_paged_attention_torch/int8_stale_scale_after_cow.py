"""copy_block that copies a block's int8 values but leaves the destination's old scales: stale after copy-on-write."""
CHECK = "minipaged.checks.kv_int8:check_copy_block"
EXPECT = ["the scales differ", "still its old ones", "scales[dst] = scales[src]"]


def my_copy_block(cache, scales, src, dst):
    cache[dst] = cache[src]
