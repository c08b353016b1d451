"""A correct proposer and rollback that the wrong answers here change one piece of (not a wrong answer itself)."""
from minipaged import BlockTable


def good_propose(token_ids, k, min_n, max_n, sizes=None, starts=None, cut=None):
    """The proposer; ``sizes(L)``, ``starts(L, n)`` and ``cut(toks, end, k)`` let a wrong answer change one rule."""
    toks = list(token_ids)
    L = len(toks)
    for n in (sizes(L) if sizes else range(max_n, min_n - 1, -1)):
        suffix = toks[L - n:]
        for start in (starts(L, n) if starts else range(L - n - 1, -1, -1)):
            if start >= 0 and toks[start:start + n] == suffix:
                draft = cut(toks, start + n, k) if cut else toks[start + n:start + n + k]
                if draft is not None:
                    return draft
    return []


class GoodBlockTable(BlockTable):
    def check_range(self, num_tokens):
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate {self.num_tokens} slots to {num_tokens}")

    def keep(self, num_tokens):
        return -(-num_tokens // self.block_size)

    def give_back(self, dropped):
        for b in reversed(dropped):
            self.allocator.free(b)

    def truncate(self, num_tokens):
        self.check_range(num_tokens)
        keep = self.keep(num_tokens)
        self.give_back(self.blocks[keep:])
        self.blocks = self.blocks[:keep]
        self.num_tokens = num_tokens
