"""An attention that passes workbook 04's check but raises on the model's head_dim (64): inside the
engine the step's requests end with an error, and the check says what raised, and where."""
CHECK = "minipaged.checks.assemble:check_engine"
EXPECT = ["ended", "with an error", "IndexError", "It was raised in your attention (04)", "line"]

EDIT = {"04_paged_attention_torch": (
    "    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]\n",
    "    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]\n"
    "    if q.shape[2] > 32:\n"
    "        raise IndexError(f'head_dim {q.shape[2]} is larger than my scratch buffer of 32')\n")}

from minipaged import LLM


def build_engine(model, tokenizer, parts, **engine_args):
    return LLM(model, tokenizer, allocator_cls=parts.allocator_cls, block_table_cls=parts.block_table_cls,
               scheduler_cls=parts.scheduler_cls, attention=parts.attention, **engine_args)
