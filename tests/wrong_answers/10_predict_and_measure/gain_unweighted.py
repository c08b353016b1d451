"""predict_gain averages the tokens held over requests, not over the time each one runs."""
CHECK = "minipaged.checks.predict:check_gain"
EXPECT = ["predict_gain", "weighted by time"]


def my_predict_gain(kv_tokens, lengths, max_len):
    held = sum(p + o / 2 for p, o in lengths) / len(lengths)
    return (kv_tokens / held) / (kv_tokens // max_len)
