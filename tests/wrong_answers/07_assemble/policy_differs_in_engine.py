"""A scheduler that passes workbook 06's check but preempts the oldest sequence under the engine's
settings (a hostile or hard-coded policy): the greedy tokens still match, the per-step schedules do not."""
CHECK = "minipaged.checks.assemble:check_engine"
EXPECT = ["scheduler's policy differs", "preempted", "<- differs"]
NEEDS_CONTRACTS = True  # the engine must serve Protocol-only parts (issue 10)

EDIT = {"06_scheduler": ("                victim = self.running[-1]\n",
                         "                victim = self.running[0] if self.max_num_batched_tokens == 16 else self.running[-1]\n")}

from minipaged.engine import LLM


def build_engine(model, tokenizer, parts, **engine_args):
    return LLM(model, tokenizer, allocator_cls=parts.allocator_cls, block_table_cls=parts.block_table_cls,
               scheduler_cls=parts.scheduler_cls, attention=parts.attention, **engine_args)
