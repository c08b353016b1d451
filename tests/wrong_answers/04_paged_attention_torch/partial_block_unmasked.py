"""Gathers whole blocks and skips the causal mask for decode ("one token needs no mask"),
so a decode step attends to the garbage after context_len in the last block."""
CHECK = "minipaged.checks.paged_attention:check_paged_attention"
EXPECT = ["differs from the reference", "EVERY slot of the last block", "partly filled"]

from functools import partial

from _base import attention

my_paged_attention = partial(attention, mask_partial=False, mask_decode=False)
