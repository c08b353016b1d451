"""A choice mask that asks xgrammar's own matcher, built from the vocabulary it is given: refused, as minipaged's is."""
CHECK = "minipaged.checks.structured:check_choice_mask"
EXPECT = ["called xgrammar.", "the library the check compares your code against (xgrammar)"]
import torch


def _gpt2_chars():
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def my_choice_mask(vocab, choices, prefix, stop_token_ids):
    import xgrammar as xgr

    c = _gpt2_chars()
    encoded = ["".join(c[b] for b in t) if t else "" for t in vocab]
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=len(vocab), stop_token_ids=list(stop_token_ids))
    grammar = xgr.GrammarCompiler(info).compile_grammar("root ::= " + " | ".join(f'"{x}"' for x in choices))
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    matcher.fill_next_token_bitmask(bitmask)
    return ((bitmask[0].unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:len(vocab)].bool()
