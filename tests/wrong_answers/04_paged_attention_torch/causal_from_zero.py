"""The causal mask puts new token i at position i, forgetting the cached prefix."""
CHECK = "minipaged.checks.paged_attention:check_paged_attention"
EXPECT = ["decode: 1 new token over 9 cached", "as if nothing were cached", "context_len - q_len + i"]

from functools import partial

from _base import attention

my_paged_attention = partial(attention, causal_offset=False)
