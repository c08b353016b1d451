"""predict_knee takes the slope between the two smallest batches."""
CHECK = "minipaged.checks.predict:check_knee"
EXPECT = ["predict_knee", "two largest batches"]
import math


def my_predict_knee(step_time, context=32, batches=(1, 32, 64)):
    floor = step_time(batches[0], context)
    slope = (step_time(batches[1], context) - step_time(batches[0], context)) / (batches[1] - batches[0])
    return floor / slope if slope > 0 else math.inf
