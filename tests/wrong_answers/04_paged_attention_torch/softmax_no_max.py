"""The softmax is exp(s) / sum(exp(s)) without subtracting the maximum: huge logits overflow."""
CHECK = "minipaged.checks.paged_attention:check_paged_attention"
EXPECT = ["huge logits", "NaN or inf", "Subtract each row's maximum"]

from functools import partial

from _base import attention

my_paged_attention = partial(attention, stable=False)
