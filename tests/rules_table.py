"""The rule table as data: every rule a workbook states -> the check that tests it -> a wrong
answer in tests/wrong_answers/ that breaks only that rule. tests/test_rules.py holds the table
to the workbooks and runs it; tests/test_checks.py runs the wrong answers the table does not.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    workbook: str  # stem of the workbook that states the rule
    rule: str  # a phrase of the workbook's text that states it
    check: str  # "module:function"
    wrong: str  # tests/wrong_answers/<workbook>/<wrong>.py: breaks only this rule
    kind: str = "rule"  # rule | numerical | sharing | preemption | delegation


KV = "minipaged.checks.kv_cache_math"
BA = "minipaged.checks.block_allocator"
BT = "minipaged.checks.block_table"
PA = "minipaged.checks.paged_attention"
KI = "minipaged.checks.kv_int8"
TD = "minipaged.checks.triton_decode"
SC = "minipaged.checks.scheduler"
AS = "minipaged.checks.assemble"
PC = "minipaged.checks.prefix_cache"
SD = "minipaged.checks.spec_decode"
PM = "minipaged.checks.predict"
SO = "minipaged.checks.structured"
KC = "minipaged.checks.kv_connector"

RULES = [
    # 01: KV-cache arithmetic
    Rule("01_kv_cache_math", "one key and one value", f"{KV}:check_bytes_per_token", "forgot_k_and_v"),
    Rule("01_kv_cache_math", "numbers of `dtype_bytes` bytes", f"{KV}:check_bytes_per_token", "forgot_dtype_bytes"),
    Rule("01_kv_cache_math", "just enough whole blocks", f"{KV}:check_bytes_per_sequence", "no_whole_blocks", "numerical"),
    Rule("01_kv_cache_math", "the last one may be partly empty", f"{KV}:check_bytes_per_sequence",
         "block_boundary_off_by_one", "numerical"),
    Rule("01_kv_cache_math", "takes only the blocks it needs", f"{KV}:check_max_seqs", "paged_by_tokens"),
    Rule("01_kv_cache_math", "Whole sequences only.", f"{KV}:check_max_seqs", "float_division"),
    Rule("01_kv_cache_math", "The checks refuse minipaged's own arithmetic in your place", f"{KV}:check_bytes_per_token", "calls_package_memory", "delegation"),
    # 02: the block allocator
    Rule("02_block_allocator", "takes the block at the **front** of the free list", f"{BA}:check_allocate_free", "lifo_free_list"),
    Rule("02_block_allocator", "sets its count to 1", f"{BA}:check_allocate_free", "allocate_no_ref_count"),
    Rule("02_block_allocator", "A freed block goes to the **back**", f"{BA}:check_allocate_free", "freed_to_front"),
    Rule("02_block_allocator", "at 0 the block is free again", f"{BA}:check_sharing", "shared_block_freed", "sharing"),
    Rule("02_block_allocator", "stays in use until both have freed it", f"{BA}:check_sharing", "shared_block_freed", "sharing"),
    Rule("02_block_allocator", "raises `OutOfBlocksError`", f"{BA}:check_allocate_free", "full_pool_indexerror"),
    Rule("02_block_allocator", "of a free block raises `BlockAllocatorError`", f"{BA}:check_sharing", "double_free_silent"),
    Rule("02_block_allocator", "Misuse raises, and changes nothing", f"{BA}:check_sharing", "misuse_changes_state"),
    Rule("02_block_allocator", "The check refuses minipaged's own `BlockAllocator` in your place", f"{BA}:check_allocate_free",
         "alias_of_reference", "delegation"),
    Rule("02_block_allocator", "called from your methods", f"{BA}:check_sharing", "wraps_reference", "delegation"),
    # 03: the block table
    Rule("03_block_table", "16 tokens in blocks of 16 fill exactly one block", f"{BT}:check_growth", "boundary_off_by_one",
         "numerical"),
    Rule("03_block_table", "**All or nothing**", f"{BT}:check_growth", "not_all_or_nothing"),
    Rule("03_block_table", "return the new blocks", f"{BT}:check_growth", "append_returns_nothing"),
    Rule("03_block_table", "`self.blocks` lists the physical blocks in logical order", f"{BT}:check_growth", "blocks_out_of_order"),
    Rule("03_block_table", "as an int64 tensor", f"{BT}:check_slot_mapping", "slots_float_division"),
    Rule("03_block_table", "`slot_mapping(start, end)`: the slots of positions", f"{BT}:check_slot_mapping", "slots_ignore_table"),
    Rule("03_block_table", "give every block back (`allocator.free(b)`, once per block)", f"{BT}:check_free", "free_leaks_blocks"),
    Rule("03_block_table", "drops only this table's one reference to each block", f"{BT}:check_free",
         "free_drops_every_reference", "sharing"),
    Rule("03_block_table", "they refuse minipaged's own `BlockTable` in your place", f"{BT}:check_growth",
         "subclass_overrides_nothing", "delegation"),
    Rule("03_block_table", "every method, `slot_mapping` included, must work from those two alone", f"{BT}:check_slot_mapping",
         "slots_kept_at_append", "sharing"),
    # 04: paged attention in PyTorch
    Rule("04_paged_attention_torch", "is physical block `block_tables[s, i]`", f"{PA}:check_gather_kv", "gather_logical_order"),
    Rule("04_paged_attention_torch", "the rest of the last block is garbage", f"{PA}:check_gather_kv", "gather_whole_last_block",
         "numerical"),
    Rule("04_paged_attention_torch", "Only the first `context_len` slots hold this sequence's tokens", f"{PA}:check_paged_attention",
         "partial_block_unmasked", "numerical"),
    Rule("04_paged_attention_torch", "query head `h` reads KV head `h // (num_heads // num_kv_heads)`",
         f"{PA}:check_paged_attention", "gqa_modulo"),
    Rule("04_paged_attention_torch", "**GQA**", f"{PA}:check_paged_attention", "gqa_clamped_heads"),
    Rule("04_paged_attention_torch", "sits at position `context_len - q_len + i`", f"{PA}:check_paged_attention", "causal_from_zero"),
    Rule("04_paged_attention_torch", "sees keys `0 ..` that position", f"{PA}:check_paged_attention", "mask_hides_diagonal",
         "numerical"),
    Rule("04_paged_attention_torch", "scores can be in the hundreds", f"{PA}:check_paged_attention", "softmax_no_max", "numerical"),
    Rule("04_paged_attention_torch", "scores = q @ k^T * scale (the `scale` argument", f"{PA}:check_paged_attention", "no_scale"),
    Rule("04_paged_attention_torch", "of either sign", f"{PA}:check_paged_attention", "masked_with_zero", "numerical"),
    Rule("04_paged_attention_torch", "a row's scores can all be negative", f"{PA}:check_paged_attention", "max_floored_at_zero",
         "numerical"),
    Rule("04_paged_attention_torch", "it refuses minipaged's attention in your place (passed under another name",
         f"{PA}:check_paged_attention", "torch_backend_alias", "delegation"),
    Rule("04_paged_attention_torch", "or called from inside yours", f"{PA}:check_paged_attention", "wraps_reference", "delegation"),
    Rule("04_paged_attention_torch", "the `scale` argument as given", f"{PA}:check_paged_attention", "default_scale", "numerical"),
    Rule("04_paged_attention_torch", "`block_size` and `num_kv_heads` are unrelated", f"{PA}:check_gather_kv",
         "gather_block_size_from_heads", "numerical"),
    Rule("04_paged_attention_torch", "minipaged's CPU kernels (`minipaged.cpu`) count as minipaged's attention too",
         f"{PA}:check_paged_attention", "calls_cpu_kernels", "delegation"),
    # 04, part 2: int8 KV pages, one scale per (block, KV head)
    Rule("04_paged_attention_torch", "is `max |x[b, :, h, :]| / 127`", f"{KI}:check_quantize", "int8_one_scale_per_layer"),
    Rule("04_paged_attention_torch", "to the **nearest** integer (`torch.round`), not truncation", f"{KI}:check_quantize",
         "int8_truncates", "numerical"),
    Rule("04_paged_attention_torch", "**Clipping to the format's range**", f"{KI}:check_quantize", "int8_no_clip", "numerical"),
    Rule("04_paged_attention_torch", "never divide by it: 0 / 0 is NaN", f"{KI}:check_quantize", "int8_zero_scale_nan",
         "numerical"),
    Rule("04_paged_attention_torch", "A scale left stale after copy-on-write", f"{KI}:check_copy_block",
         "int8_stale_scale_after_cow", "sharing"),
    Rule("04_paged_attention_torch", "each block's values times its scales", f"{KI}:check_gather_kv_int8",
         "int8_gather_logical_scales"),
    Rule("04_paged_attention_torch", "an attention that ignores the scales", f"{KI}:check_paged_attention_int8",
         "int8_attention_ignores_scales"),
    Rule("04_paged_attention_torch", "The checks refuse minipaged's int8 page code in your place", f"{KI}:check_quantize",
         "int8_kv_quant_alias", "delegation"),
    Rule("04_paged_attention_torch", "passed under another name, or called from inside yours.", f"{KI}:check_quantize",
         "int8_calls_kv_quant", "delegation"),
    # 05: the Triton decode kernel
    Rule("05_triton_decode_kernel", "`block = block_tables[seq, i]`", f"{TD}:check_decode", "logical_block_order"),
    Rule("05_triton_decode_kernel", "(**mask** the rest: they are garbage)", f"{TD}:check_decode", "tail_unmasked", "numerical"),
    Rule("05_triton_decode_kernel", "load K of KV head `head // (NUM_HEADS // NUM_KV_HEADS)`", f"{TD}:check_decode", "gqa_modulo"),
    Rule("05_triton_decode_kernel", "`alpha = exp(m - m_new)`", f"{TD}:check_decode", "no_rescale", "numerical"),
    Rule("05_triton_decode_kernel", 'Start from `m = float("-inf")`', f"{TD}:check_decode", "max_starts_at_zero", "numerical"),
    Rule("05_triton_decode_kernel", "The check refuses minipaged's own Triton kernels", f"{TD}:check_decode",
         "wraps_package_kernel", "delegation"),
    # 06: the scheduler
    Rule("06_scheduler", "reject at once", f"{SC}:check_rejection", "never_rejects"),
    Rule("06_scheduler", "a prompt of `max_model_len` tokens or more", f"{SC}:check_rejection", "prompt_limit_off_by_one"),
    Rule("06_scheduler", "more blocks than the *whole* pool", f"{SC}:check_rejection", "rejects_on_free_blocks"),
    Rule("06_scheduler", "`out.num_batched_tokens` = tokens scheduled", f"{SC}:check_admission", "batched_tokens_unset"),
    Rule("06_scheduler", "n = min(seq.num_tokens - seq.num_computed_tokens, budget)", f"{SC}:check_admission",
         "past_token_budget"),
    Rule("06_scheduler", "len(self.running) < self.max_num_seqs", f"{SC}:check_admission", "ignores_max_num_seqs"),
    Rule("06_scheduler", "nobody skips the head", f"{SC}:check_admission", "skips_the_head"),
    Rule("06_scheduler", "preempt `self.running[-1]` (the most recently admitted", f"{SC}:check_preemption", "preempts_oldest",
         "preemption"),
    Rule("06_scheduler", "but not in a step that preempted", f"{SC}:check_preemption", "admits_after_preempting", "preemption"),
    Rule("06_scheduler", "free its blocks (`seq.block_table.free()`", f"{SC}:check_preemption", "preempt_without_free",
         "preemption"),
    Rule("06_scheduler", "set `num_computed_tokens = 0`", f"{SC}:check_preemption", "preempt_keeps_progress", "preemption"),
    Rule("06_scheduler", "put it at the **front** of `self.waiting`", f"{SC}:check_preemption", "preempted_to_back", "preemption"),
    Rule("06_scheduler", "add 1 to `seq.num_preemptions` and `self.num_preemptions`", f"{SC}:check_preemption",
         "preemptions_uncounted", "preemption"),
    Rule("06_scheduler", "and append it to `out.preempted`", f"{SC}:check_preemption", "preempted_not_recorded", "preemption"),
    Rule("06_scheduler", "*Running first*, in the order of `self.running`, while `budget > 0`", f"{SC}:check_admission",
         "budget_stops_at_one", "numerical"),
    Rule("06_scheduler", "the check refuses a scheduler whose `add_request` or `schedule` is minipaged's", f"{SC}:check_admission",
         "subclass_overrides_nothing", "delegation"),
    Rule("06_scheduler", "or calls it (`super().schedule()`", f"{SC}:check_admission", "calls_reference_schedule", "delegation"),
    Rule("06_scheduler", "The policy is yours", f"{SC}:check_preemption", "alias_of_reference", "delegation"),
    # 07: the assembled engine
    Rule("07_assemble", "it checks that every part serving is yours", f"{AS}:check_engine", "reference_scheduler", "delegation"),
    Rule("07_assemble", "no call into minipaged's own allocator, table, scheduling policy or attention", f"{AS}:check_engine",
         "reference_attention", "delegation"),
    Rule("07_assemble", "it also compares every step's schedule", f"{AS}:check_engine", "policy_differs_in_engine", "preemption"),
    Rule("07_assemble", "with a deliberately small KV pool", f"{AS}:check_engine", "ignores_engine_args"),
    Rule("07_assemble", "plugs them into minipaged's engine, and serves SmolLM2-135M-Instruct with them", f"{AS}:check_engine",
         "attention_raises_in_engine"),
    Rule("07_assemble", "**from your own workbook files**", f"{AS}:load_parts", "missing_workbook"),
    Rule("07_assemble", "runs each part's check again", f"{AS}:load_parts", "part_fails_its_check"),
    # 08: the prefix cache and copy-on-write
    Rule("08_prefix_caching", "`parent` is the previous block's hash", f"{PC}:check_hash_chain", "hash_without_parent"),
    Rule("08_prefix_caching", "two blocks are the same only if their whole prefixes are", f"{PC}:check_lookup_and_eviction",
         "chain_restarts_at_root"),
    Rule("08_prefix_caching", "Only **full** blocks", f"{PC}:check_lookup_and_eviction", "caches_partial_block"),
    Rule("08_prefix_caching", "It looks only at `token_ids[:-1]`", f"{PC}:check_lookup_and_eviction", "last_token_counted"),
    Rule("08_prefix_caching", "A cached block at ref count 0 is **evictable**", f"{PC}:check_lookup_and_eviction",
         "evicts_referenced_block", "sharing"),
    Rule("08_prefix_caching", "evict the least recently released evictable block", f"{PC}:check_lookup_and_eviction",
         "evicts_most_recent"),
    Rule("08_prefix_caching", "minus the cache's own hold", f"{PC}:check_lookup_and_eviction", "counts_own_hold", "sharing"),
    Rule("08_prefix_caching", "whose `table.allocator.ref_count(b) > 1`", f"{PC}:check_copy_on_write",
         "writes_into_shared_block", "sharing"),
    Rule("08_prefix_caching", "A block this table holds alone is written in place", f"{PC}:check_copy_on_write",
         "copies_blocks_held_alone", "sharing"),
    Rule("08_prefix_caching", "**You write** `MyPrefixCache`", f"{PC}:check_lookup_and_eviction", "minipaged_own",
         "delegation"),
    Rule("08_prefix_caching", "Never use Python's `hash()`", f"{PC}:check_hash_chain", "python_hash"),
    Rule("08_prefix_caching", "every id goes into the hash whole", f"{PC}:check_hash_chain", "hash_one_byte_per_id", "numerical"),
    Rule("08_prefix_caching", "Neither: raise `OutOfBlocksError`", f"{PC}:check_lookup_and_eviction", "full_pool_keyerror"),
    Rule("08_prefix_caching", "the inner pool's `allocate()` while it has a free block", f"{PC}:check_lookup_and_eviction",
         "evicts_while_pool_has_free"),
    Rule("08_prefix_caching", "raise `OutOfBlocksError` before changing anything", f"{PC}:check_copy_on_write",
         "cow_not_all_or_nothing"),
    Rule("08_prefix_caching", "a write of no positions (`start == end`) touches no block", f"{PC}:check_copy_on_write",
         "cow_empty_write_copies", "numerical"),
    Rule("08_prefix_caching", "minipaged's own prefix cache and copy-on-write in your place", f"{PC}:check_copy_on_write",
         "cow_calls_reference", "delegation"),
    # 08: beam search on the learner's fork, free and copy-on-write (LLM.beam_search, side by side)
    Rule("08_prefix_caching", "each block's ref count goes up by one", f"{PC}:check_beam_search", "fork_without_incref",
         "sharing"),
    Rule("08_prefix_caching", "in a list of its own", f"{PC}:check_beam_search", "fork_shares_the_list", "sharing"),
    Rule("08_prefix_caching", "and the parent's `num_tokens`", f"{PC}:check_beam_search", "fork_forgets_num_tokens"),
    Rule("08_prefix_caching", "gives every block back **at once**", f"{PC}:check_beam_search", "free_table_late", "sharing"),
    Rule("08_prefix_caching", "then the table holds nothing", f"{PC}:check_beam_search", "free_table_keeps_blocks_listed"),
    Rule("08_prefix_caching", "copies only the last, partly filled block a beam writes into", f"{PC}:check_beam_search",
         "beam_cow_copies_every_block", "sharing"),
    Rule("08_prefix_caching", "A block its siblings share (ref count > 1) is copied before the beam writes into it",
         f"{PC}:check_beam_search", "beam_cow_writes_into_shared_block", "sharing"),
    Rule("08_prefix_caching", "It refuses minipaged's own `fork_table` and `free_table`", f"{PC}:check_beam_search",
         "fork_calls_reference", "delegation"),
    # 09: speculative decoding: the n-gram proposer and the block-table rollback
    Rule("09_speculative_decoding", "`[]` when there is none (never `None`)", f"{SD}:check_proposer", "returns_none"),
    Rule("09_speculative_decoding", "The suffix itself is not an earlier occurrence", f"{SD}:check_proposer", "matches_itself"),
    Rule("09_speculative_decoding", "An earlier occurrence may overlap the suffix", f"{SD}:check_proposer", "no_overlap",
         "numerical"),
    Rule("09_speculative_decoding", "**The longest n-gram wins.**", f"{SD}:check_proposer", "shortest_ngram_first"),
    Rule("09_speculative_decoding", "No n-gram longer than `max_n`", f"{SD}:check_proposer", "ignores_max_n"),
    Rule("09_speculative_decoding", "none shorter than `min_n`", f"{SD}:check_proposer", "ignores_min_n"),
    Rule("09_speculative_decoding", "**The most recent earlier occurrence wins**", f"{SD}:check_proposer", "first_occurrence"),
    Rule("09_speculative_decoding", "at most `k` of them", f"{SD}:check_proposer", "returns_whole_continuation"),
    Rule("09_speculative_decoding", "fewer than `k` when the sequence ends sooner", f"{SD}:check_proposer",
         "skips_short_continuations", "numerical"),
    Rule("09_speculative_decoding", "it sets `self.num_tokens = num_tokens`", f"{SD}:check_truncate", "num_tokens_unchanged"),
    Rule("09_speculative_decoding", "a partly filled last block stays", f"{SD}:check_truncate", "keeps_floor_blocks",
         "numerical"),
    Rule("09_speculative_decoding", "a block left holding no slot goes too", f"{SD}:check_truncate", "keeps_empty_block",
         "numerical"),
    Rule("09_speculative_decoding", "last block first", f"{SD}:check_truncate", "frees_first_block_first"),
    Rule("09_speculative_decoding", "it gives every block it drops back", f"{SD}:check_truncate", "drop_leaks_blocks"),
    Rule("09_speculative_decoding", "loses only this table's reference", f"{SD}:check_truncate", "frees_shared_block_to_zero",
         "sharing"),
    Rule("09_speculative_decoding", "a rollback never grows the table", f"{SD}:check_truncate", "grows_past_the_end"),
    Rule("09_speculative_decoding", "raises `ValueError`", f"{SD}:check_truncate", "raises_indexerror"),
    Rule("09_speculative_decoding", "raises `ValueError` and changes nothing", f"{SD}:check_truncate", "changes_before_raising"),
    Rule("09_speculative_decoding", "Use only the pool's members of the contract", f"{SD}:check_truncate", "pool_internals"),
    Rule("09_speculative_decoding", "The checks refuse minipaged's own proposer and rollback", f"{SD}:check_proposer",
         "calls_propose_ngram", "delegation"),
    Rule("09_speculative_decoding", "called from inside yours", f"{SD}:check_truncate", "calls_truncate_table", "delegation"),
    Rule("09_speculative_decoding", "minipaged's own `BlockTable` (without a `truncate` of yours)", f"{SD}:check_truncate",
         "minipaged_own_table", "delegation"),
    Rule("09_speculative_decoding", "passed under another name", f"{SD}:check_serving", "serves_reference_proposer",
         "delegation"),
    # 10: predict, then measure (the predictions and the decision ledger)
    Rule("10_predict_and_measure", "one key and one value for each KV head", f"{PM}:check_kv_capacity", "forgot_k_and_v"),
    Rule("10_predict_and_measure", "each taking whole blocks", f"{PM}:check_kv_capacity", "seqs_by_tokens", "numerical"),
    Rule("10_predict_and_measure", "between the two largest batches", f"{PM}:check_knee", "knee_from_first_two"),
    Rule("10_predict_and_measure", "at the `context` and `batches` it is given", f"{PM}:check_knee", "knee_fixed_context"),
    Rule("10_predict_and_measure", "`float(\"inf\")` when that slope is 0 or less", f"{PM}:check_knee", "knee_flat_is_zero",
         "numerical"),
    Rule("10_predict_and_measure", "a request right at a target meets it", f"{PM}:check_goodput", "goodput_strict_bound",
         "numerical"),
    Rule("10_predict_and_measure", "**and** whose time per output token", f"{PM}:check_goodput", "goodput_ttft_only"),
    Rule("10_predict_and_measure", "per second of the offered window", f"{PM}:check_goodput", "goodput_fraction"),
    Rule("10_predict_and_measure", "its prompt plus half its output", f"{PM}:check_gain", "gain_whole_output"),
    Rule("10_predict_and_measure", "Weighted by how long each request runs", f"{PM}:check_gain", "gain_unweighted"),
    Rule("10_predict_and_measure", "two **all-reduces** a layer", f"{PM}:check_tensor_parallel", "one_all_reduce_a_layer"),
    Rule("10_predict_and_measure", "a ring's `2 (n - 1) / n`", f"{PM}:check_tensor_parallel", "tp_no_ring_factor"),
    Rule("10_predict_and_measure", "`step_s / n` of compute", f"{PM}:check_tensor_parallel", "tp_compute_not_split"),
    Rule("10_predict_and_measure", "`float(\"inf\")` when it is at least `k + 1`", f"{PM}:check_break_even",
         "break_even_no_inf", "numerical"),
    Rule("10_predict_and_measure", "`1 + a + a^2 + ... + a^k` tokens", f"{PM}:check_break_even", "break_even_linear"),
    Rule("10_predict_and_measure", "passed under another name or called from inside yours", f"{PM}:check_break_even",
         "calls_machine_break_even", "delegation"),
    Rule("10_predict_and_measure", "The checks refuse minipaged's own answers in your place", f"{PM}:check_knee",
         "machine_knee_itself", "delegation"),
    Rule("10_predict_and_measure", "`statistics.stdev`", f"{PM}:check_ledger", "interval_population_stdev", "numerical"),
    Rule("10_predict_and_measure", "repeat `i` of each a pair", f"{PM}:check_ledger", "interval_of_means"),
    Rule("10_predict_and_measure", "(an end exactly at it included)", f"{PM}:check_ledger", "verdict_keeps_at_the_bar",
         "numerical"),
    Rule("10_predict_and_measure", "surely at least 5% faster", f"{PM}:check_ledger", "verdict_against_one"),
    Rule("10_predict_and_measure", "at least 3 repeats", f"{PM}:check_ledger", "two_repeats"),
    Rule("10_predict_and_measure", "**the same requests with the same seeds**", f"{PM}:check_ledger", "different_requests"),
    Rule("10_predict_and_measure", "back to back", f"{PM}:check_ledger", "arms_not_interleaved"),
    Rule("10_predict_and_measure", "the verdict that interval supports", f"{PM}:check_ledger", "verdict_contradicts_interval"),
    Rule("10_predict_and_measure", "the interval from its own runs' seconds", f"{PM}:check_ledger", "interval_not_from_samples"),
    Rule("10_predict_and_measure", "two optimisations, each timed against a matched control", f"{PM}:check_ledger",
         "one_optimisation"),
    # 11: structured outputs (the token mask of a choice list, against xgrammar's)
    Rule("11_structured_outputs", "A prefix that is no choice's beginning allows", f"{SO}:check_choice_mask",
         "off_trie_restarts_at_root"),
    Rule("11_structured_outputs", "**A token is allowed when all of its bytes walk on**", f"{SO}:check_choice_mask",
         "first_byte_only"),
    Rule("11_structured_outputs", "A token may end inside a choice", f"{SO}:check_choice_mask", "whole_choices_only"),
    Rule("11_structured_outputs", "**Not past the end of a choice.**", f"{SO}:check_choice_mask", "runs_past_choice_end",
         "numerical"),
    Rule("11_structured_outputs", "one may begin another", f"{SO}:check_choice_mask", "stops_at_first_choice_end"),
    Rule("11_structured_outputs", "**Bytes, not characters.**", f"{SO}:check_choice_mask", "decodes_tokens_to_text"),
    Rule("11_structured_outputs", "spell no text: never allowed", f"{SO}:check_choice_mask", "special_tokens_allowed"),
    Rule("11_structured_outputs", "are allowed exactly when the prefix is a whole", f"{SO}:check_choice_mask",
         "no_stop_at_whole_choice", "numerical"),
    Rule("11_structured_outputs", "choice, and only then", f"{SO}:check_choice_mask", "stop_tokens_everywhere"),
    Rule("11_structured_outputs", "**The stop tokens** it is given", f"{SO}:check_choice_mask", "fixed_eos"),
    Rule("11_structured_outputs", "returns a `torch.bool` tensor of shape", f"{SO}:check_choice_mask", "returns_a_list"),
    Rule("11_structured_outputs", "The check refuses minipaged's own trie walk", f"{SO}:check_choice_mask",
         "minipaged_own_choice_mask", "delegation"),
    Rule("11_structured_outputs", "called from inside yours", f"{SO}:check_choice_mask", "calls_reference_choice_mask",
         "delegation"),
    Rule("11_structured_outputs", "and xgrammar's matcher", f"{SO}:check_choice_mask", "uses_xgrammar_matcher", "delegation"),
    # 12: the host tier behind the KV connector
    Rule("12_kv_connector", "a full store evicts its **least recently used** block", f"{KC}:check_store", "evicts_most_recent"),
    Rule("12_kv_connector", "`get(h)` of a stored block makes it the most recently used", f"{KC}:check_store",
         "get_does_not_refresh"),
    Rule("12_kv_connector", "a full store never fails a request", f"{KC}:check_store", "store_full_raises"),
    Rule("12_kv_connector", "a new block takes the lowest free slot", f"{KC}:check_store", "slots_from_the_top"),
    Rule("12_kv_connector", "after the first `num_computed_tokens`", f"{KC}:check_connector", "counts_from_block_zero"),
    Rule("12_kv_connector", "It is never the block holding the last token", f"{KC}:check_connector", "last_token_counted",
         "numerical"),
    Rule("12_kv_connector", "The count stops at the first block the store does not hold", f"{KC}:check_connector",
         "skips_a_miss"),
    Rule("12_kv_connector", "the **last** `num_external_tokens // block_size`", f"{KC}:check_connector",
         "loads_into_first_blocks"),
    Rule("12_kv_connector", "Save only the blocks this step made full", f"{KC}:check_connector", "saves_partial_block"),
    Rule("12_kv_connector", "`request_finished(seq)` forgets the request", f"{KC}:check_connector",
         "keeps_finished_hashes"),
    Rule("12_kv_connector", "The checks refuse minipaged's own host tier", f"{KC}:check_connector", "minipaged_own",
         "delegation"),
]
# Wrong answers that test the checks' own machinery (time limit, a renamed class), not a stated rule.
NOT_A_RULE = {"02_block_allocator/endless_loop", "07_assemble/renamed_class"}

# The watch's own wrong answers (tests/wrong_answers/_plant.py): ways around the delegation watch, planted in every
# workbook where they apply (tests/test_checks.py::test_every_watched_workbook_plants_each_way_around_the_watch).
# A workbook that does not take one says why here.
WATCH_PLANTS = ("unlisted_module", "recompiled_reference", "prestarted_thread")
WATCH_PLANTS_NOT_APPLICABLE = {
    "01_kv_cache_math/recompiled_reference": "its reference functions are one-line formulas, shorter than any code "
                                             "the watch matches by fingerprint: a copy of one is the formula itself",
    "07_assemble/unlisted_module": "07 runs the parts of 02-06: their own plants are refused in their workbooks",
    "07_assemble/recompiled_reference": "07 runs the parts of 02-06: their own plants are refused in their workbooks",
    "07_assemble/prestarted_thread": "07 runs the parts of 02-06: their own plants are refused in their workbooks",
}
NOT_A_RULE |= {f"{wb}/{plant}" for wb in ("01_kv_cache_math", "02_block_allocator", "03_block_table",
                                          "04_paged_attention_torch", "05_triton_decode_kernel", "06_scheduler",
                                          "07_assemble", "08_prefix_caching", "09_speculative_decoding",
                                          "10_predict_and_measure", "11_structured_outputs", "12_kv_connector")
               for plant in WATCH_PLANTS}


# The rows run by tests/test_rules.py (workbook 07's need the model: tests/test_checks.py runs those).
RUN = [r for r in RULES if not r.workbook.startswith("07_")]
RUN_FILES = {f"{r.workbook}/{r.wrong}" for r in RUN}
