"""predict_knee ignores the context it is given and prices every step at 32 tokens."""
CHECK = "minipaged.checks.predict:check_knee"
EXPECT = ["predict_knee", "context=128", "Use the context and batches you are given"]
import math


def my_predict_knee(step_time, context=32, batches=(1, 32, 64)):
    floor = step_time(batches[0], 32)
    slope = (step_time(batches[-1], 32) - step_time(batches[-2], 32)) / (batches[-1] - batches[-2])
    return floor / slope if slope > 0 else math.inf
