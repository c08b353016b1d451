"""Structured outputs: a grammar turned into a token mask, one step at a time (backend: xgrammar).

Owns the engine's side of ``SamplingParams(structured_outputs=...)``:

- **compiling** (:meth:`StructuredOutputs.compile`): the request's form (a JSON schema, a regex,
  a choice list, EBNF) is compiled once against the tokenizer's vocabulary, when the request is
  added (a bad form is a ValueError there, before any work). Compiled grammars are cached by
  their text, so a thousand requests with one schema compile it once.
- **one matcher per sequence** (:class:`_Matcher`): a pushdown automaton over the grammar that
  has read the sequence's output tokens. Its state is a function of those tokens and nothing
  else: before each step it is brought up to ``seq.output_token_ids`` (tokens it has not read
  are fed to it; tokens it read that are no longer there are rolled back, or, past its rollback
  window, the matcher is rebuilt from the tokens). So preemption by recompute (the tokens stay,
  the KV is recomputed), n > 1 (each sample its own matcher, from its own tokens) and prefix
  caching (the KV is shared, the tokens decide the matcher) need nothing of their own.
- **the mask** (:meth:`StructuredOutputs.apply`): each step every constrained row fills its row of
  one bitmask (a bit per vocabulary token: 1 = the grammar can go on with it), and the whole
  batch's logits are masked at once (refused tokens get -inf) before the Sampler chooses, greedy
  or sampled. A row the grammar leaves no token for (none, or none of ``allowed_token_ids``, or
  only EOS while ``min_tokens`` holds it back) is reported, so the engine ends that request with
  an error and samples the others.
- **speculative decoding** (:meth:`trim_drafts`, :meth:`mask_after`): a draft the grammar refuses
  is cut before it is verified, and the target token at each verified position is chosen from
  logits masked by the matcher advanced over the drafts before it, then rolled back: a kept
  draft is a token the grammar allowed.

When the grammar is satisfied, its mask allows only the stop tokens (EOS), so the request
finishes with ``stop``.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Iterable

import torch

from .structured_params import StructuredOutputsParams, clean_backend_error
from .optional import require

BACKEND = "xgrammar"
CACHE_SIZE = 128  # compiled grammars kept (least recently used dropped)


def encoded_vocab(tokenizer: Any, vocab_size: int) -> list[str]:
    """Every token id's spelling in the tokenizer's own alphabet (byte-level BPE: GPT-2's byte
    characters), "" for special tokens (so the grammar never treats ``<|im_end|>`` as text)
    and for ids past the tokenizer's vocabulary (a padded embedding table)."""
    backend = tokenizer.backend
    vocab = [""] * vocab_size
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = text
    for i, added in backend.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            vocab[i] = ""
    return vocab


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int] = ()):
    """xgrammar's TokenizerInfo for minipaged's Tokenizer (byte-level BPE, as SmolLM2 and Llama use)."""
    xgr = require("xgrammar")

    stops = list(dict.fromkeys(list(stop_token_ids) or list(getattr(tokenizer, "eos_token_ids", ()))))
    return xgr.TokenizerInfo(encoded_vocab(tokenizer, vocab_size), xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                             stop_token_ids=stops or None)


class StructuredOutputError(ValueError):
    """A structured-output request the engine cannot serve (bad form, no tokenizer)."""


class _Matcher:
    """One sequence's grammar state: the xgrammar matcher and the output tokens it has read."""

    __slots__ = ("compiled", "stops", "matcher", "read")

    def __init__(self, compiled: Any, stops: list[int]) -> None:
        xgr = require("xgrammar")

        self.compiled, self.stops = compiled, stops
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self.read: list[int] = []

    def sync(self, tokens: list[int]) -> bool:
        """Bring the matcher to ``tokens`` (the sequence's output so far). False when the grammar
        refuses one of them (it did not come through this mask)."""
        read = self.read
        if len(read) <= len(tokens) and tokens[: len(read)] == read:
            keep = len(read)
        else:
            keep = 0
            while keep < min(len(read), len(tokens)) and read[keep] == tokens[keep]:
                keep += 1
            back = len(read) - keep
            if back and self.matcher.max_rollback_tokens not in (-1,) and back > self.matcher.max_rollback_tokens:
                self.matcher.reset()  # past the rollback window: rebuild from the tokens
                del read[:]
                keep = 0
            elif back:
                self.matcher.rollback(back)
                del read[keep:]
        for t in tokens[keep:]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                return False
            read.append(int(t))
        return True


class StructuredOutputs:
    """The engine's grammar state: compiled grammars (cached), a matcher per constrained sequence,
    and the step's bitmask. ``tokenizer``: minipaged's Tokenizer; ``vocab_size``: the logits' width."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = require("xgrammar")

        if tokenizer is None or not hasattr(tokenizer, "backend"):
            raise StructuredOutputError("structured outputs need the model's tokenizer (the grammar is matched against "
                                        "its vocabulary); this engine takes token ids only")
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.info = tokenizer_info(tokenizer, vocab_size, self.eos)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._compiled: collections.OrderedDict = collections.OrderedDict()
        self._matchers: dict[Any, _Matcher] = {}
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._lock = threading.Lock()
        self.num_masked_rows = 0  # rows masked so far (all steps)
        self.mask_seconds = 0.0  # time spent filling and applying masks (all steps)

    # -- compiling ------------------------------------------------------------------------------
    def compile(self, so: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``so`` (cached by its text); ValueError naming the error."""
        key = so.key
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        kind, text, compact = key
        c = self.compiler
        try:
            if kind == "json":
                compiled = c.compile_json_schema(text, any_whitespace=not compact)
            elif kind == "json_object":
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=not compact)
            elif kind == "regex":
                compiled = c.compile_regex(text)
            else:
                compiled = c.compile_grammar(text)
        except Exception as e:
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "json_object": "JSON grammar"}[kind]
            raise StructuredOutputError(f"invalid {what} for structured outputs: {clean_backend_error(e)}") from None
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    # -- matchers -------------------------------------------------------------------------------
    @staticmethod
    def wants(seq: Any) -> bool:
        p = getattr(seq, "sampling_params", None)
        return p is not None and getattr(p, "structured_outputs", None) is not None

    def _stops(self, seq: Any) -> list[int]:
        return list(dict.fromkeys(list(seq.eos_token_ids or self.eos) + list(seq.stop_token_ids)))

    def matcher(self, seq: Any) -> _Matcher:
        """``seq``'s matcher, made when first asked for (the grammar is compiled already: cached)."""
        m = self._matchers.get(seq.seq_id)
        if m is None:
            m = self._matchers[seq.seq_id] = _Matcher(self.compile(seq.sampling_params.structured_outputs), self._stops(seq))
        return m

    def remove(self, seq_id: Any) -> None:
        self._matchers.pop(seq_id, None)

    def _fill(self, seq: Any, row: int, prefix: list[int] = ()) -> str | None:
        """Fill bitmask row ``row`` for ``seq`` after its output tokens and then ``prefix``; the
        matcher is left after the output tokens. A message when the grammar refuses a token."""
        m = self.matcher(seq)
        if not m.sync(list(seq.output_token_ids)):
            return (f"the grammar refuses output token {len(m.read)} (id {seq.output_token_ids[len(m.read)]}): "
                    "the text can no longer follow it")
        n = 0
        for t in prefix:
            if not m.matcher.accept_token(int(t)):
                break
            n += 1
        try:
            if n == len(prefix):
                m.matcher.fill_next_token_bitmask(self._bitmask, row)
            else:
                self._bitmask[row].zero_()
        finally:
            if n:
                m.matcher.rollback(n)
        return None

    def _ensure_rows(self, rows: int) -> None:
        if self._bitmask.shape[0] < rows:
            self._bitmask = self.xgr.allocate_token_bitmask(max(rows, 2 * self._bitmask.shape[0]), self.vocab_size)

    # -- the mask -------------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, seqs: list) -> dict[int, str]:
        """Mask ``logits`` (M, V) in place, row i for ``seqs[i]``: every constrained row's refused
        tokens get -inf, the batch in one call. Returns {row: why} for rows left with no token."""
        import time

        rows = [i for i, q in enumerate(seqs) if self.wants(q)]
        if not rows:
            return {}
        t0 = time.perf_counter()
        self._ensure_rows(logits.shape[0])
        dead: dict[int, str] = {}
        for i in rows:
            why = self._fill(seqs[i], i)
            if why is not None:
                self._bitmask[i].zero_()
                dead[i] = why
        self.xgr.apply_token_bitmask_inplace(logits, self._bitmask[: logits.shape[0]].to(logits.device),
                                             vocab_size=self.vocab_size, indices=rows)
        for i in rows:
            if i not in dead:
                why = no_token_left(logits[i], seqs[i])
                if why is not None:
                    dead[i] = why
        self.num_masked_rows += len(rows)
        self.mask_seconds += time.perf_counter() - t0
        return dead

    def mask_after(self, seq: Any, prefix: list[int], row: torch.Tensor) -> torch.Tensor:
        """``row`` (1, V) masked for the position after ``seq``'s output and then ``prefix``
        (speculative decoding: drafts already kept); the matcher is rolled back afterwards."""
        self._ensure_rows(1)
        self._fill(seq, 0, list(prefix))
        row = row.float().clone()
        self.xgr.apply_token_bitmask_inplace(row, self._bitmask[:1].to(row.device), vocab_size=self.vocab_size)
        return row

    def trim_drafts(self, seqs: Iterable) -> int:
        """Cut each constrained sequence's drafts before the first token the grammar refuses
        (the matcher rolls back to where it was). Returns how many draft tokens were cut."""
        cut = 0
        for seq in seqs:
            drafts = getattr(seq, "spec_token_ids", None)
            if not drafts or not self.wants(seq):
                continue
            m = self.matcher(seq)
            if not m.sync(list(seq.output_token_ids)):
                seq.spec_token_ids = []
                cut += len(drafts)
                continue
            n = 0
            for t in drafts:
                if m.matcher.is_terminated() or not m.matcher.accept_token(int(t)):
                    break
                n += 1
            if n:
                m.matcher.rollback(n)
            if n < len(drafts):
                cut += len(drafts) - n
                seq.spec_token_ids = list(drafts[:n])
        return cut

    def stats(self) -> dict:
        return {"backend": BACKEND, "compiled_grammars": len(self._compiled), "matchers": len(self._matchers),
                "masked_rows": self.num_masked_rows, "mask_seconds": self.mask_seconds}


def no_token_left(row: torch.Tensor, seq: Any) -> str | None:
    """Why no token can follow (None: some can): ``row`` is the masked logits; the request's own
    ``allowed_token_ids`` and ``min_tokens`` (which holds EOS back) are counted too."""
    ok = torch.isfinite(row) | (row == float("inf"))
    ok &= row != float("-inf")
    if not bool(ok.any()):
        return "the grammar allows no token at this point (no token of the vocabulary can continue it)"
    p = seq.sampling_params
    if p.allowed_token_ids is not None:
        ids = torch.tensor([t for t in p.allowed_token_ids if t < row.numel()], dtype=torch.long)
        if ids.numel() == 0 or not bool(ok[ids].any()):
            return "the grammar allows none of allowed_token_ids here: no token can continue the text"
    if p.min_tokens and len(seq.output_token_ids) < p.min_tokens:
        held = [t for t in set(seq.eos_token_ids) | set(seq.stop_token_ids) if t < row.numel()]
        rest = ok.clone()
        if held:
            rest[torch.tensor(held, dtype=torch.long)] = False
        if not bool(rest.any()):
            return (f"the grammar is complete and allows only EOS, which min_tokens={p.min_tokens} holds back: "
                    "no token can continue the text")
    return None


# -- the same mask by hand, for a choice list (lesson 13's exercise checks against xgrammar's) ---------
def token_bytes(tokenizer: Any, vocab_size: int) -> list:
    """Each token id's bytes (byte-level BPE: the GPT-2 characters mapped back to bytes); None for
    special tokens and ids past the tokenizer's vocabulary (they never spell text)."""
    from .model.tokenizer import _bytes_to_unicode

    back = {c: b for b, c in _bytes_to_unicode().items()}
    out: list = []
    for text in encoded_vocab(tokenizer, vocab_size):
        out.append(bytes(back[c] for c in text) if text and all(c in back for c in text) else None)
    return out


def choice_mask(vocab_bytes: list, choices: list[str], prefix: bytes, stop_token_ids: Iterable[int]) -> torch.Tensor:
    """The tokens that may follow ``prefix`` when the output must be one of ``choices``, by a trie
    walk: a trie of the choices' bytes, walked along the prefix; a token is allowed when its bytes
    walk on from there, a stop token when the prefix is a whole choice. Returns a bool (V,) mask."""
    trie: dict = {}
    for c in choices:
        node = trie
        for b in c.encode("utf-8"):
            node = node.setdefault(b, {})
        node[None] = True  # a choice ends here
    node = trie
    for b in prefix:
        node = node.get(b)
        if node is None:
            return torch.zeros(len(vocab_bytes), dtype=torch.bool)
    allowed = torch.zeros(len(vocab_bytes), dtype=torch.bool)
    for t, tb in enumerate(vocab_bytes):
        if not tb:
            continue
        n = node
        for b in tb:
            n = n.get(b)
            if n is None:
                break
        else:
            allowed[t] = True
    if None in node:
        for t in stop_token_ids:
            allowed[t] = True
    return allowed


def grammar_mask(structured: "StructuredOutputs", seq: Any) -> torch.Tensor:
    """xgrammar's mask for ``seq`` after its output tokens, as a bool (V,) tensor (True: allowed)."""
    logits = torch.zeros(1, structured.vocab_size)
    structured.apply(logits, [seq])
    return logits[0] != float("-inf")


__all__ = ["BACKEND", "token_bytes", "choice_mask", "grammar_mask", "StructuredOutputs", "StructuredOutputError", "encoded_vocab", "tokenizer_info", "no_token_left"]
