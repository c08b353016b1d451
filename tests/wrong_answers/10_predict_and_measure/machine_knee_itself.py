"""The knee is minipaged's own function of the profile, passed under another name."""
CHECK = "minipaged.checks.predict:check_knee"
EXPECT = ["minipaged's own", "predict_knee"]
from minipaged.checks.predict import ref_knee as my_predict_knee  # noqa: F401
