"""build_engine drops **engine_args, so the engine runs with its roomy defaults instead of
the small pool that makes it preempt, chunk and reject."""
CHECK = "minipaged.checks.assemble:check_engine"
EXPECT = ["does not use all of your parts and settings", "**engine_args unchanged", "num_blocks=", "(asked for 7)"]

from minipaged import LLM


def build_engine(model, tokenizer, parts, **engine_args):
    return LLM(model, tokenizer, allocator_cls=parts.allocator_cls, block_table_cls=parts.block_table_cls,
               scheduler_cls=parts.scheduler_cls, attention=parts.attention)
