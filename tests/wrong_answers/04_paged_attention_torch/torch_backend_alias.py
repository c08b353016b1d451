"""minipaged's torch backend passed as the learner's own function: refused before it runs."""
CHECK = "minipaged.checks.paged_attention:check_paged_attention"
EXPECT = ["is minipaged's own minipaged.attention.torch_sdpa.paged_attention"]

from minipaged.attention.torch_sdpa import paged_attention as my_paged_attention  # noqa: F401
