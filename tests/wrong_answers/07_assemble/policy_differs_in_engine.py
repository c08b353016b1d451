"""A scheduler that passes workbook 06's check but, under the engine's settings only (a hostile or
hard-coded policy), uses one token less of the budget: the greedy tokens still match, the schedules do not."""
CHECK = "minipaged.checks.assemble:check_engine"
EXPECT = ["scheduler's policy differs", "first at step 1", "<- differs", "rN+T@P"]
NEEDS_CONTRACTS = True  # the engine must serve Protocol-only parts (issue 10)

EDIT = {"06_scheduler": ("        budget = self.max_num_batched_tokens\n",
                         "        budget = self.max_num_batched_tokens - ((self.allocator.num_blocks, self.allocator.block_size, "
                         "self.max_num_seqs, self.max_num_batched_tokens) == (7, 4, 4, 16))\n")}

from minipaged import LLM


def build_engine(model, tokenizer, parts, **engine_args):
    return LLM(model, tokenizer, allocator_cls=parts.allocator_cls, block_table_cls=parts.block_table_cls,
               scheduler_cls=parts.scheduler_cls, attention=parts.attention, **engine_args)
