"""predict_gain counts a request's whole output as held all the time (no half)."""
CHECK = "minipaged.checks.predict:check_gain"
EXPECT = ["predict_gain", "half its output"]


def my_predict_gain(kv_tokens, lengths, max_len):
    held = sum(o * (p + o) for p, o in lengths) / sum(o for _, o in lengths)
    return (kv_tokens / held) / (kv_tokens // max_len)
