"""Checks for workbook 05: a learner's Triton paged-decode kernel against the reference.

On a CUDA GPU the kernel is compiled; without one it runs in Triton's interpreter on the
CPU, which must be switched on (TRITON_INTERPRET=1) before any kernel is defined:
``setup_triton()`` does that and says what it did. Where Triton is not installed (macOS,
Windows) the check prints why it skips instead of failing.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Callable

import torch

from ._core import DEFAULT_TIMEOUT_S, CheckFailed, is_stub, not_implemented, passed, skipped
from ._delegation import refuse_package_function
from .paged_attention import MAX_MODEL_LEN, Case, attention_cases, check_attention_fn, reused_cases

NAME = "05 Triton decode kernel"


class _Missing(types.ModuleType):
    """Stands in for triton / triton.language where Triton is not installed, so that the
    workbook's kernel cell can still be run (the decorator leaves the function as it is)."""

    def __getattr__(self, name):
        return _Missing(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @triton.jit
        return lambda fn: fn  # @triton.jit(...) with arguments


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def setup_triton(verbose: bool = True):
    """Return ``(triton, tl)``: compiled on a GPU, the CPU interpreter otherwise, stand-ins without Triton."""
    if not triton_installed():
        if verbose:
            print("Triton is not installed here (it has no build for macOS or Windows), so this workbook cannot run "
                  "your kernel. You can still write it; the check cells will say SKIPPED. To run it: open this "
                  "workbook on Google Colab, or on Linux with `pip install triton`.")
        return _Missing("triton"), _Missing("triton.language")
    if not torch.cuda.is_available():
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1" and verbose:
            print("note: triton was imported before TRITON_INTERPRET=1 was set; kernels defined from now on still run "
                  "in the interpreter. If a kernel fails with a CUDA or driver error, restart the kernel and run the cells in order.")
        os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language as tl

    if verbose:
        where = (f"compiled for {torch.cuda.get_device_name()}" if torch.cuda.is_available()
                 else "in Triton's interpreter on the CPU (TRITON_INTERPRET=1): correct but slow, fine for checking")
        print(f"triton {triton.__version__}: kernels run {where}.")
    return triton, tl


def _no_rescale(case: Case) -> torch.Tensor:
    """Online softmax that forgets to rescale the running sum and accumulator when the max grows."""
    q, kc, vc, bt, ctx, _, scale = case.args()
    bs, hkv = kc.shape[1], kc.shape[2]
    h = q.shape[1]
    out = torch.zeros_like(q, dtype=torch.float32)
    for s, (c, _) in enumerate(case.seqs):
        for hh in range(h):
            kvh = hh // (h // hkv)
            m, l, acc = float("-inf"), 0.0, torch.zeros(q.shape[-1])
            for i in range(-(-c // bs)):
                n = min(bs, c - i * bs)
                blk = int(bt[s, i])
                k = kc[blk, :n, kvh].float()
                v = vc[blk, :n, kvh].float()
                sc = (k @ q[s, hh].float()) * scale
                m = max(m, sc.max().item())
                p = torch.exp(sc - m)
                acc = acc + p @ v
                l = l + p.sum().item()
            out[s, hh] = acc / l
    return out


def _device_case(case: Case, device: str) -> Case:
    if device == "cpu":
        return case.cpu()
    c = Case(**{**case.__dict__})
    for name in ("q", "k_cache", "v_cache", "block_tables", "context_lens", "query_start_loc"):
        setattr(c, name, getattr(case, name).to(device))
    return c


def check_decode(paged_decode: Callable, kernel=None, timeout: float = DEFAULT_TIMEOUT_S,
                 atol: float = 2e-3, rtol: float = 2e-3) -> None:
    """``paged_decode`` (the reference signature, one new token per sequence) on decode batches.

    ``kernel`` is the @triton.jit function, if you pass it the check can tell a stub from a crash.
    """
    if not triton_installed():
        skipped("Triton is not installed on this machine (it has no macOS or Windows build), so the kernel cannot run "
                "here. Run this workbook on Google Colab (GPU or CPU runtime) or on Linux to check it.")
        return
    refuse_package_function(paged_decode, NAME, "paged_decode")
    if kernel is not None:
        refuse_package_function(kernel, NAME, "paged_decode_kernel")
    if kernel is not None and is_stub(kernel):
        name = getattr(getattr(kernel, "fn", kernel), "__name__", "the kernel")
        raise not_implemented(name)
    if is_stub(paged_decode):
        raise not_implemented(getattr(paged_decode, "__name__", "paged_decode"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [_device_case(c, device) for c in attention_cases(decode_only=True)]
    try:
        n = check_attention_fn(paged_decode, NAME, cases, timeout, atol, rtol, fn_name="paged_decode", workbook="05",
                               reused=tuple(_device_case(c, device) for c in reused_cases()))
    except CheckFailed as e:
        msg = str(e)
        if "differs from the reference" in msg and "Hint: your output matches" not in msg:
            case = next((c for c in cases if f'"{c.name}"' in msg), None)
            if case is not None and any(ctx > case.k_cache.shape[1] for ctx, _ in case.seqs):
                try:
                    got = paged_decode(*case.args())
                    alt = _no_rescale(case.cpu())
                    if torch.allclose(got.float().cpu(), alt, atol=atol * 10, rtol=rtol * 10):
                        raise CheckFailed(msg.split("\n\nHint:")[0] + (
                            "\n\nHint: your output matches an online softmax that does not rescale: when a new block raises "
                            "the running max from m to m_new, multiply acc and l by alpha = exp(m - m_new) before adding the "
                            "new block's terms. One-block contexts pass without it; longer ones do not.")) from None
                except CheckFailed:
                    raise
                except Exception:
                    pass
        raise
    mode = "compiled on the GPU" if device == "cuda" else "in Triton's CPU interpreter"
    passed(f"Triton paged decode ({mode}): {n} decode batches (one and many blocks, out-of-order tables, GQA, a "
           f"block-boundary context, huge logits, SmolLM2's max_model_len of {MAX_MODEL_LEN}, the same tensors changed "
           "in place and handed in again) matched the reference.")


check = check_decode

__all__ = ["check", "check_decode", "setup_triton", "triton_installed"]
