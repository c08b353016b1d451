"""What the course's workbooks check a learner's code against: one module per workbook.

    01 kv_cache_math     check_bytes_per_token, check_bytes_per_sequence, check_max_seqs
    02 block_allocator   check_allocate_free, check_sharing
    03 block_table       check_growth, check_slot_mapping, check_free
    04 paged_attention   check_gather_kv, check_paged_attention
    05 triton_decode     check_decode (and setup_triton)
    06 scheduler         check_admission, check_preemption, check_rejection
    07 assemble          load_parts, check_engine
    08 prefix_cache      check_hash_chain, check_lookup_and_eviction, check_copy_on_write
    09 spec_decode       check_proposer, check_truncate, check_serving
    10 predict           check_kv_capacity, check_knee, check_goodput, check_gain, check_tensor_parallel,
                         check_break_even, check_ledger
    11 structured        check_choice_mask (against xgrammar's mask on the same vocabulary)

Every check drives your code and the reference side by side on the same seeded operations,
compares the state after each one, and stops at the first difference with what was done,
what was expected, what came, and a hint. A failure raises CheckFailed (an AssertionError),
so nbval marks exactly that cell; a stub raises NotImplementedYet ("not implemented yet:
<function>"); a check that runs past its time limit raises CheckTimeout.

A check refuses minipaged's own implementation in the learner's place (_delegation.py): the
class or function itself under any name, a subclass that leaves a member the learner must
write to the package, and, while the learner's code runs, any call into the package's
implementation of that part (a wrapper, super(), a copied method). The parts are driven only
through the Protocol members of minipaged.interfaces and the free functions of minipaged.parts.
tests/rules_table.py maps every rule a workbook states to its check and a wrong answer.
"""
from ._core import CheckFailed, CheckTimeout, NotImplementedYet

__all__ = ["CheckFailed", "CheckTimeout", "NotImplementedYet"]
