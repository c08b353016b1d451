"""build_engine plugs in minipaged's Scheduler instead of the learner's."""
CHECK = "minipaged.checks.assemble:check_engine"
EXPECT = ["does not use all of your parts", "scheduler_cls=parts.scheduler_cls"]

from minipaged import Scheduler
from minipaged import LLM


def build_engine(model, tokenizer, parts, **engine_args):
    return LLM(model, tokenizer, allocator_cls=parts.allocator_cls, block_table_cls=parts.block_table_cls,
               scheduler_cls=Scheduler, attention=parts.attention, **engine_args)
