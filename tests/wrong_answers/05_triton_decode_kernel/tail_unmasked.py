"""The kernel reads every slot of the last block: positions past context_len are not masked."""
CHECK = "minipaged.checks.triton_decode:check_decode"
EXPECT = ["decode: 1 new token over 9 cached", "EVERY slot of the last block"]

from _base import make

my_paged_decode = make(mask_tail=False)
