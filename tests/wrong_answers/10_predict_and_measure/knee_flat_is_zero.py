"""predict_knee returns 0 where adding a sequence costs nothing (the knee is never reached: inf)."""
CHECK = "minipaged.checks.predict:check_knee"
EXPECT = ["the same at every batch", "inf when that slope is 0 or less"]


def my_predict_knee(step_time, context=32, batches=(1, 32, 64)):
    floor = step_time(batches[0], context)
    slope = (step_time(batches[-1], context) - step_time(batches[-2], context)) / (batches[-1] - batches[-2])
    return floor / slope if slope > 0 else 0.0
