"""The learner's folder has no 06_scheduler workbook."""
CHECK = "minipaged.checks.assemble:load_parts"
DROP = ["06_scheduler"]
EXPECT = ["cannot be used yet (06_scheduler)", "06_scheduler.ipynb: not found", "set WORKBOOKS"]
