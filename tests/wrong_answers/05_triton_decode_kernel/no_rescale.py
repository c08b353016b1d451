"""Online softmax without the exp(m_old - m_new) correction of acc and l."""
CHECK = "minipaged.checks.triton_decode:check_decode"
EXPECT = ["differs from the reference", "does not rescale", "alpha = exp(m - m_new)"]

from _base import make

my_paged_decode = make(rescale=False)
