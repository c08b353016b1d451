"""break_even calls minipaged's own machine.break_even_acceptance from inside a function of its own."""
CHECK = "minipaged.checks.predict:check_break_even"
EXPECT = ["called minipaged", "break_even_acceptance", "minipaged's own implementation"]
from minipaged import machine


def my_break_even(ratio, k):
    return float(machine.break_even_acceptance(ratio, k))
