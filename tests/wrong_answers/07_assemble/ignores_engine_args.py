"""build_engine drops **engine_args, so the engine runs with its roomy defaults: nothing is
preempted, and the prompt that this small pool can never hold is served instead of rejected."""
CHECK = "minipaged.checks.assemble:check_engine"
EXPECT = ["answers differ from the reference engine", "rejected", "passes every part and ENGINE_ARGS"]

from minipaged.engine import LLM


def build_engine(model, tokenizer, parts, **engine_args):
    return LLM(model, tokenizer, allocator_cls=parts.allocator_cls, block_table_cls=parts.block_table_cls,
               scheduler_cls=parts.scheduler_cls, attention=parts.attention)
