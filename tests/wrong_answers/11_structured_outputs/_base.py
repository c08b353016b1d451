"""The solved choice mask of workbook 11 with each of its rules switchable (not a wrong answer itself): every
wrong answer here turns one rule off."""
import torch


def trie(choices):
    root = {}
    for c in choices:
        node = root
        for b in c.encode("utf-8"):
            node = node.setdefault(b, {})
        node[None] = True
    return root


def mask(vocab, choices, prefix, stop_token_ids, *, off_trie="nothing", walk="all", whole_only=False, past_end=False,
         stop_at_end=False, decode=False, specials=False, stops="given"):
    root = trie(choices)
    allowed = torch.zeros(len(vocab), dtype=torch.bool)
    node = root
    for b in prefix:
        node = node.get(b)
        if node is None:
            if off_trie == "nothing":
                return allowed
            node = root  # off_trie == "root": starts again at the root
    for t, token in enumerate(vocab):
        if token is None:
            if not specials:
                continue
            token = b""
        if decode:  # the token as text: undecodable pieces of a character are skipped
            try:
                token = token.decode("utf-8").encode("utf-8")
            except UnicodeDecodeError:
                continue
        n, ok = node, True
        for i, b in enumerate(token):
            if walk == "first" and i >= 1:
                break
            if None in n and past_end:
                break  # a whole choice reached: the rest of the token is not looked at
            if None in n and stop_at_end:
                ok = False  # a whole choice reached: goes no further
                break
            n = n.get(b)
            if n is None:
                ok = False
                break
        if ok and whole_only and (n is None or None not in n):
            ok = False
        if ok:
            allowed[t] = True
    if stops == "always" or (stops != "never" and None in node):
        for t in ([2] if stops == "fixed" else list(stop_token_ids)):
            allowed[t] = True
    return allowed
