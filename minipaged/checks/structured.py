"""Checks for workbook 11: the token mask of a ``choice`` list, by a trie walk over the vocabulary.

- ``check_choice_mask(choice_mask)``: the learner's ``choice_mask(vocab, choices, prefix, stop_token_ids)``
  and xgrammar's mask (a GrammarMatcher compiled from the same choice list, on SmolLM2's own vocabulary,
  brought to the same prefix) are computed side by side on fixed stories and on seeded random ones
  (shared beginnings, a choice that begins another, multi-byte characters, a prefix that is a whole
  choice, a prefix that is no choice's beginning). They must agree on every one of the 49,152 tokens;
  a difference names the tokens, their bytes, and the rule that explains them. After the fixed stories
  the same vocabulary and choice lists come back changed in place (a mask kept by id() shows), and the
  vocabulary grows to Qwen2.5's 151,936 ids, with stop tokens past 16 bits (an id narrowed to 16 bits
  shows); there the trie walk's mask is the expected one.

xgrammar's matcher cannot stand after a prefix that no choice begins with; there the expected mask is
minipaged's own trie walk (``minipaged.structured_output.choice_mask``), which the check first holds to
xgrammar's on every other case. The learner may call neither: minipaged's choice_mask and xgrammar's
matcher, compiler and helpers are refused in the learner's place, statically and while the learner's
code runs (see _delegation.py).
"""
from __future__ import annotations

import random
from typing import Any, Callable, Iterator

import torch

from . import _delegation
from ._core import SITUATIONS, CheckFailed, DEFAULT_TIMEOUT_S, builds, failure, learner_call, passed, run_with_time_limit
from ..optional import require
from ._delegation import guarded, refuse_reference_function

NAME = "11 structured outputs"
WORKBOOK = "11"
# The situations of workbook 11's rules that _core's vocabulary does not name (issue 40).
SITUATIONS.update({
    "off every choice": "a prefix no choice begins with (off at its first byte, or after bytes along a choice)",
    "inside a choice": "a prefix partway through a choice, not a whole one",
    "whole choice": "a prefix that is a whole choice: the stop tokens' turn",
    "choice begins another": "a whole choice that begins a longer one (Pos, Posh), so the walk goes on past its end",
    "multi-token path": "tokens that end inside a choice (a choice takes several tokens)",
    "token leaves a choice": "tokens whose first bytes walk along a choice and whose later bytes leave it",
    "token past a choice's end": "tokens that reach the end of a choice halfway and go on with bytes no choice holds",
    "multi-byte characters": "choices with characters of several bytes (é, ü, 日本, 🙂), and a prefix that ends inside one",
    "special tokens": "special tokens in the vocabulary (None: they spell no text)",
    "stop tokens given": "stop tokens other than the model's EOS alone (two of them)",
    "another vocabulary": "a vocabulary other than SmolLM2's 49,152 tokens (Qwen2.5's 151,936 ids)",
})

# What workbook 11 must not delegate to: minipaged's grammar code (choice_mask by trie walk, the engine's matchers)
# and xgrammar's own matcher, compiler and helpers (watched by their files: xgrammar is not the package).
_delegation.WATCH.setdefault(WORKBOOK, [("minipaged.structured_output", None), ("minipaged.structured_params", None),
                                        ("xgrammar.matcher", None), ("xgrammar.compiler", None),
                                        ("xgrammar.grammar", None), ("xgrammar.testing", None),
                                        ("xgrammar.tokenizer_info", None)])
# The check hands the learner only plain data (bytes, str, ints): no package code may run from theirs.
_delegation.ALLOW.setdefault(WORKBOOK, [])

_STATE: dict = {}  # the tokenizer's vocabulary and xgrammar's compiler, made once a session


def _setup() -> dict:
    if not _STATE:
        from ..model import load_model
        from ..structured_output import StructuredOutputs, token_bytes

        model, tok = load_model(None)
        V = model.config.vocab_size
        vocab = token_bytes(tok, V)
        structured = StructuredOutputs(tok, V)
        by_bytes: dict = {}
        for t, b in enumerate(vocab):
            if b:
                by_bytes.setdefault(b, t)
        _STATE.update(tok=tok, V=V, vocab=vocab, structured=structured, by_bytes=by_bytes,
                      longest=max(len(b) for b in by_bytes), eos=list(tok.eos_token_ids))
    return _STATE


def _spell(prefix: bytes) -> list[int] | None:
    """Token ids whose bytes, one after the other, are ``prefix`` (longest match first)."""
    st, out, i = _STATE, [], 0
    while i < len(prefix):
        for n in range(min(st["longest"], len(prefix) - i), 0, -1):
            t = st["by_bytes"].get(prefix[i:i + n])
            if t is not None:
                out.append(t)
                i += n
                break
        else:
            return None
    return out


def xgrammar_mask(choices: list[str], prefix: bytes, stops: list[int]) -> torch.Tensor | None:
    """xgrammar's mask (bool, V) for ``choices`` after ``prefix``; None where its matcher cannot stand there."""
    xgr = require("xgrammar")

    from ..sampling_params import StructuredOutputsParams

    st = _setup()
    compiled = st["structured"].compile(StructuredOutputsParams(choice=list(choices)))
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stops))
    for t in _spell(prefix) or []:
        if not matcher.accept_token(t):
            return None
    if _spell(prefix) is None:
        return None
    bitmask = xgr.allocate_token_bitmask(1, st["V"])
    matcher.fill_next_token_bitmask(bitmask)
    return ((bitmask[0].unsqueeze(1) >> torch.arange(32)) & 1).flatten()[: st["V"]].bool()


# -- the cases ------------------------------------------------------------------------------------
_WORDS = ["Positive", "Negative", "Neutral", "Pos", "Posh", "yes", "no", "maybe", "café", "cafe", "café au lait",
          "naïve", "Paris", "Par", "Parisian", "12:30", "12:45", "1:00", '"on"', '"off"', "a b", "a", "Zürich",
          "日本", "日本語", "🙂 ok", "New York", "New", "north", " space", "x"]
# A vocabulary of Qwen2.5's size (151,936 ids): its regular tokens end at 151,643, where its special tokens
# begin (None: they spell no text), among them the stop tokens <|endoftext|> and <|im_end|>.
QWEN_VOCAB, QWEN_REGULAR, QWEN_STOPS = 151_936, 151_643, [151_643, 151_645]
# The SITUATIONS of a prefix partway through a choice, on SmolLM2's vocabulary (which holds 17 special tokens):
# tokens end inside the choice. Each case names those its prefix adds: tokens that start along a choice and leave
# it, tokens that reach a choice's end and go on.
_INSIDE = ("special tokens", "inside a choice", "multi-token path")
_LEAVE, _PAST = "token leaves a choice", "token past a choice's end"


def _cases(seed: int, runs: int, vocab: list) -> Iterator[tuple]:
    """(label, vocab, choices, prefix bytes, stop token ids, SITUATIONS) as they are handed in, one case at a time:
    between two cases the last ones change the lists handed in before, in place."""
    s = [2]
    whole = ("special tokens", "whole choice")
    fixed = [
        ("before the first token", ["Positive", "Negative", "Neutral"], b"", s, ("empty", _LEAVE) + _INSIDE),
        ("two choices still open", ["Positive", "Negative", "Neutral"], b"Ne", s, (_LEAVE,) + _INSIDE),
        ("one choice left, inside it", ["Positive", "Negative", "Neutral"], b"Neg", s, (_LEAVE, _PAST) + _INSIDE),
        ("a whole choice written: only the stop tokens", ["Positive", "Negative", "Neutral"], b"Negative", s, whole),
        ("a choice that begins others: the stop tokens and the tokens that go on", ["Pos", "Posh", "Positive"], b"Pos", s,
         whole + ("choice begins another", "multi-token path", _LEAVE, _PAST)),
        ("a short choice list", ["yes", "no"], b"y", s, (_LEAVE, _PAST) + _INSIDE),
        ("bytes, not characters: é is two bytes", ["café au lait", "cafe"], b"caf", s,
         ("multi-byte characters", _LEAVE, _PAST) + _INSIDE),
        ("a prefix that ends inside a character", ["café au lait", "cafe"], "café".encode()[:4], s,
         ("multi-byte characters",) + _INSIDE),
        ("a space inside a choice", ["a b", "a"], b"a", s, whole + ("choice begins another", "multi-token path", _LEAVE,
                                                                    _PAST)),
        ("no choice begins with this prefix: nothing is allowed", ["yes", "no"], b"x", s, ("off every choice",)),
        ("no choice begins with this prefix, though one begins its first byte", ["Positive", "Negative"], b"Px", s,
         ("off every choice",)),
        ("digits and a colon", ["12:30", "12:45", "1:00"], b"12:", s, _INSIDE),
        ("the stop tokens given (two of them)", ["Paris", "Parisian"], b"Paris", [0, 2],
         whole + ("stop tokens given", "choice begins another", "multi-token path", _LEAVE, _PAST)),
        ("quotes in a choice", ['"on"', '"off"'], b'"o', s, (_LEAVE,) + _INSIDE),
    ]
    for label, choices, prefix, stops, situations in fixed:
        yield label, list(vocab), list(choices), prefix, list(stops), situations
    # After the fixed stories, so that every rule is named on its own story first. The same vocabulary and choice lists
    # handed in again, changed in place: a mask (or a trie) kept by id() of an argument belongs to the
    # old lists. Then the vocabulary grows to Qwen2.5's size: ids past 16 bits, each beside the id it aliases in
    # 16 bits (id % 65,536), which spells another token.
    same_vocab, same_choices = list(vocab), ["yes", "no"]
    yield ("a vocabulary and a choice list that come back in the next cases", same_vocab, same_choices, b"", s,
           ("empty", _LEAVE, _PAST) + _INSIDE)
    same_choices[:] = ["Positive", "Negative", "Neutral"]
    ne = b"Ne"
    yield ("the same choice list, now other choices (changed in place)", same_vocab, same_choices, ne, s,
           ("reused object", _LEAVE) + _INSIDE)
    same_choices[:] = ["Never", "Nearly"]  # every argument the very object of the last call: only the contents moved
    yield ("the same lists and prefix once more, the choices changed in place again", same_vocab, same_choices, ne, s,
           ("reused object",) + _INSIDE)
    same_choices[:] = ["Positive", "Negative", "Neutral"]
    same_vocab += [vocab[t % len(vocab)] for t in range(len(vocab), QWEN_REGULAR)]
    same_vocab += [None] * (QWEN_VOCAB - QWEN_REGULAR)
    yield (f"the same vocabulary, grown in place to Qwen2.5's size ({QWEN_VOCAB:,} ids: SmolLM2's tokens repeated, "
           f"special tokens from {QWEN_REGULAR:,})", same_vocab, same_choices, b"Ne", QWEN_STOPS,
           ("reused object", "another vocabulary", "ids past 16 bits", "stop tokens given", _LEAVE) + _INSIDE)
    yield (f"a whole choice in Qwen2.5's vocabulary: its stop tokens {QWEN_STOPS} (ids past 16 bits) and no others",
           same_vocab, same_choices, b"Negative", QWEN_STOPS,
           ("another vocabulary", "ids past 16 bits", "whole choice", "stop tokens given", "special tokens"))
    rng = random.Random(seed)
    for i in range(runs):
        choices = rng.sample(_WORDS, rng.randint(1, 5))
        pick = rng.choice(choices).encode()
        cut = rng.randint(0, len(pick))
        prefix = pick[:cut]
        if rng.random() < 0.15:  # off every choice
            prefix += bytes([rng.choice(b"qjvQ!")])
        stops = [2] if rng.random() < 0.7 else [0, 2]
        yield f"random case {i + 1} of {runs} (seed {seed})", list(vocab), choices, prefix, stops, ("random stories",)

# -- why a mask differs ----------------------------------------------------------------------------
def _trie(choices: list[str]) -> dict:
    root: dict = {}
    for c in choices:
        node = root
        for b in c.encode():
            node = node.setdefault(b, {})
        node[None] = True
    return root


def _walk(node: dict | None, data: bytes) -> tuple[dict | None, bool]:
    """(the node after ``data``, or None where it leaves the trie; whether it passed a whole choice on the way)."""
    passed_end = False
    for b in data:
        if node is None:
            break
        if None in node:
            passed_end = True
        node = node.get(b)
    return node, passed_end


def _show_tokens(ids: list[int], vocab: list) -> str:
    shown = [f"{t} {vocab[t]!r}" if vocab[t] is not None else f"{t} (special)" for t in ids[:6]]
    return ", ".join(shown) + (f", ... ({len(ids)} in all)" if len(ids) > 6 else "")


HINTS = {
    "off": "walk the prefix's bytes down the trie first; when a byte has no child there, no choice begins with the "
           "prefix and NO token is allowed (an all-False mask), stop tokens included.",
    "stop_early": "allow the stop tokens only when the prefix is a whole choice (its node marks the end of one): "
                  "before that the request would finish with half a choice.",
    "stop_missing": "when the prefix is a whole choice (its node marks the end of one), allow every id in "
                    "stop_token_ids (the ones given, not a fixed EOS): the request may finish there.",
    "special": "a vocabulary entry of None is a special token (it spells no text): never allow it, though its "
               "empty bytes would walk nowhere and so 'stay' in the trie.",
    "past_end": "a token must not run past the end of a choice: after the last byte of a choice the next byte of the "
                "token needs a child in the trie like any other (a whole choice reached halfway through a token does "
                "not make the rest of the token free).",
    "diverges": "every byte of a token must walk on in the trie, not only its first ones: a token that starts along "
                "a choice and then leaves it would leave the output matching no choice.",
    "multi": "a token may end inside a choice (multi-token paths): it need not finish a choice, the next step goes on "
             "from where it ends. Allow every token whose bytes all walk on from the prefix's node.",
    "bytes": "walk the tokens' BYTES, not decoded text: a token may hold part of a multi-byte character "
             "(é is b'\\xc3\\xa9', and b'\\xc3' alone is a token), and it is allowed when its bytes walk on.",
    "begins_other": "a whole choice can begin a longer one (Pos, Posh): at its end keep walking, the tokens that go on "
                    "into the longer choice are allowed too.",
    "ids": "token ids go up to len(vocab) - 1 (151,935 in Qwen2.5's vocabulary, past 16 bits): keep every id a Python "
           "int (or torch.int64). An id narrowed to 16 bits (int16, uint16, array('H')) lands on another token, "
           "id % 65,536.",
    "reused": "this call hands in the same lists as the call before, changed in place since: build the trie and read "
              "the vocabulary from what they hold now, every call (a mask or trie kept by id() of an argument belongs "
              "to what it held before).",
}


def _why(got: torch.Tensor, exp: torch.Tensor, vocab: list, choices: list, prefix: bytes, stops: list) -> str:
    node, _ = _walk(_trie(choices), prefix)
    extra = (got & ~exp).nonzero().flatten().tolist()
    missing = (exp & ~got).nonzero().flatten().tolist()
    if node is None and extra:
        return HINTS["off"]
    # An id past 16 bits refused, or one allowed where an id it aliases in 16 bits (t + 65,536 k) is allowed.
    if [t for t in missing if t >= 1 << 16] or [t for t in extra if bool(exp[t + (1 << 16)::1 << 16].any())]:
        return HINTS["ids"]
    if [t for t in extra if vocab[t] is None and t not in stops]:
        return HINTS["special"]
    if [t for t in extra if t in stops]:
        return HINTS["stop_early"]
    if [t for t in missing if t in stops]:
        return HINTS["stop_missing"]
    left = [_walk(node, vocab[t]) for t in extra if vocab[t] is not None]
    if any(end is None and not passed_end for end, passed_end in left):
        return HINTS["diverges"]
    if left and all(end is None for end, _ in left):
        return HINTS["past_end"]
    for t in missing:
        b = vocab[t]
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            return HINTS["bytes"]
        end, passed_end = _walk(node, b)
        if passed_end:
            return HINTS["begins_other"]
        if end is not None and None not in end:
            return HINTS["multi"]
    return ("build a trie of the choices' bytes (a dict per node, a mark where a choice ends), walk the prefix down it, "
            "then allow each token whose bytes all walk on from there, and the stop tokens where a choice ends.")


def _refuse(fn: Any) -> None:
    from ..structured_output import choice_mask as ref

    refuse_reference_function(fn, ref, NAME, "choice_mask", "minipaged.structured_output")


def check_choice_mask(choice_mask: Callable, seed: int = 0, runs: int = 16, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``choice_mask(vocab, choices, prefix, stop_token_ids)`` equals xgrammar's mask on every case, token for token."""
    from ..structured_output import choice_mask as ref

    _refuse(choice_mask)
    st = _setup()
    V = st["V"]
    state = {"current": "", "n": 0, "xgr": 0}

    def kept_by_id(case: tuple, exp: torch.Tensor, what: str) -> bool:
        """A wrong mask of lists handed in again that is right on fresh copies of them: one kept by id()."""
        _, vocab, choices, prefix, stops, situations = case
        if "reused object" not in situations:
            return False
        fresh = learner_call(choice_mask, list(vocab), list(choices), bytes(prefix), list(stops), what=what)
        return isinstance(fresh, torch.Tensor) and fresh.dtype == torch.bool and torch.equal(fresh, exp)

    def body():
        with guarded(WORKBOOK, NAME):
            builds("package code in place")
            for case in _cases(seed, runs, st["vocab"]):
                label, vocab, choices, prefix, stops, situations = case
                builds(*situations)
                what = f"choice_mask(vocab, {choices!r}, {prefix!r}, {stops})"
                state["current"] = f"{what}  ({label})"
                exp = ref(vocab, choices, prefix, stops)
                # xgrammar's matcher is compiled on SmolLM2's own vocabulary: another one has the trie walk's alone.
                theirs = xgrammar_mask(choices, prefix, stops) if len(vocab) == V else None
                if theirs is not None:
                    if not torch.equal(exp, theirs):  # the reference is held to xgrammar before it judges anyone
                        raise RuntimeError(f"minipaged's trie walk and xgrammar disagree on {what}: please report this")
                    state["xgr"] += 1
                got = learner_call(choice_mask, vocab, choices, prefix, stops, what=what)  # the very objects: the reused ones show
                n = len(vocab)
                if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or tuple(got.shape) != (n,):
                    desc = (f"a {got.dtype} tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor)
                            else f"{type(got).__name__}")
                    raise failure(f"{NAME}: {what} returned {desc}.", done=f"Case: {label}.",
                                  expected=f"a torch.bool tensor of shape ({n},): one entry per token of vocab",
                                  got=desc, hint=HINTS["reused"] if kept_by_id(case, exp, what) else (
                                      "start from torch.zeros(len(vocab), dtype=torch.bool) and set allowed[t] = True "
                                      "for each allowed token id t."))
                state["n"] += 1
                if not torch.equal(got, exp):
                    extra = (got & ~exp).nonzero().flatten().tolist()
                    missing = (exp & ~got).nonzero().flatten().tolist()
                    side = ("xgrammar's mask" if theirs is not None else
                            "the reference's mask (no xgrammar matcher can stand there)" if n == V else
                            "the reference's mask (xgrammar's matcher here knows SmolLM2's vocabulary only)")
                    raise failure(
                        f"{NAME}: {what} differs from {side}.",
                        done=(f"Case: {label}.\n    choices = {choices!r}\n    prefix = {prefix!r}\n"
                              f"    stop_token_ids = {stops}"),
                        expected=f"{int(exp.sum())} tokens allowed: {_show_tokens(exp.nonzero().flatten().tolist(), vocab)}",
                        got=(f"{int(got.sum())} tokens allowed"
                             + (f"; allowed, but the grammar refuses: {_show_tokens(extra, vocab)}" if extra else "")
                             + (f"; refused, but the grammar allows: {_show_tokens(missing, vocab)}" if missing else "")),
                        hint=(HINTS["reused"] if kept_by_id(case, exp, what)
                              else _why(got, exp, vocab, choices, prefix, stops)))

    run_with_time_limit(body, timeout, NAME, lambda: state["current"])
    passed(f"choice mask: {state['n']} cases over the {V:,} tokens of SmolLM2's vocabulary (and Qwen2.5's "
           f"{QWEN_VOCAB:,} ids, some lists changed in place between calls); {state['xgr']} of them side by side with "
           "xgrammar's mask on the same vocabulary, the rest (no choice begins with the prefix, or another vocabulary) "
           "with the trie walk's: equal on every token.")


__all__ = ["check_choice_mask", "xgrammar_mask", "NAME"]
