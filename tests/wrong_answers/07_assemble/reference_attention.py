"""build_engine leaves attention at the engine's default, minipaged's own."""
CHECK = "minipaged.checks.assemble:check_engine"
EXPECT = ["does not use all of your parts", "attention=parts.attention", "minipaged's own"]

from minipaged import LLM


def build_engine(model, tokenizer, parts, **engine_args):
    return LLM(model, tokenizer, allocator_cls=parts.allocator_cls, block_table_cls=parts.block_table_cls,
               scheduler_cls=parts.scheduler_cls, **engine_args)
