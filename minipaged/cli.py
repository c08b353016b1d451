"""The command line: ``minipaged demo | serve | bench [SUB] | grade | info``, one argparse tree.

Owns the commands' names and wiring only: each command's module declares its own arguments
(``add_arguments(parser)``) and does the work (``run(args)``). The ``bench`` branch is the
bench's own (``minipaged.bench.commands``), imported here and never the other way round."""
from __future__ import annotations

import argparse
import sys
import textwrap
import time

DEMO_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook, one sentence each.",
    "Explain what a CPU cache is to a ten-year-old.",
    "What is 12 times 7?",
    "Name three planets in our solar system.",
    "Suggest a name for a friendly robot.",
    "Why is the sky blue? Keep it short.",
    "Translate 'good morning' into Spanish and German.",
    "What should I pack for a weekend hiking trip?",
]


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .llm import LLM
    from .sampling import SamplingParams

    torch.set_num_threads(max(1, torch.get_num_threads()))
    print("minipaged demo: one engine, many chat requests at once, on a paged KV cache.\n")
    print("loading the model ...", flush=True)
    t = time.perf_counter()
    llm = LLM(args.model, block_size=args.block_size, attention=args.attention, max_num_seqs=args.max_num_seqs)
    cfg = llm.engine.model.config
    print(
        f"loaded {cfg.name} in {time.perf_counter() - t:.1f} s: {cfg.num_layers} layers, {cfg.num_heads} heads "
        f"({cfg.num_kv_heads} KV heads), vocab {cfg.vocab_size}; attention backend: {llm.engine.backend.name}"
    )
    eng = llm.engine
    print(
        f"KV cache: {eng.allocator.num_blocks} blocks x {eng.block_size} tokens = {eng.kv_cache.nbytes / 2**20:.0f} MiB "
        f"({eng.kv_bytes_per_token} bytes per token)\n"
    )
    prompts = [[{"role": "user", "content": p}] for p in DEMO_PROMPTS[: args.num_prompts]]
    if args.num_prompts > len(DEMO_PROMPTS):
        prompts += [[{"role": "user", "content": f"Tell me a fact about the number {i}."}] for i in range(args.num_prompts - len(prompts))]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t
    for msgs, o in zip(prompts, outs):
        print(f"\n> {msgs[0]['content']}")
        print(textwrap.indent(textwrap.fill(o.text.strip() or "(empty)", 100), "  "))
        print(f"  [{len(o.token_ids)} tokens, finished: {o.finish_reason}]")
    st = eng.stats()
    gen = sum(len(o.token_ids) for o in outs)
    print("\n--- what the engine did ---")
    print(f"requests              {len(outs)} (served together, continuous batching)")
    print(f"tokens generated      {gen} in {wall:.1f} s = {gen / wall:.1f} tokens/s")
    print(f"engine steps          {st['steps']}")
    print(f"peak blocks used      {st.get('peak_blocks_used', '?')} of {st['num_blocks']} (block size {st['block_size']})")
    if "kv_waste" in st:
        print(f"KV waste              {st['kv_waste'] * 100:.1f}% of reserved slots unused (reserved but not yet filled)")
    print(f"peak concurrent seqs  {st.get('peak_concurrency', '?')}")
    print(f"preemptions           {st['preemptions']}")
    print(f"steps by route        {', '.join(f'{k} x{v}' for k, v in sorted(st['routes'].items()))}")
    print("the plan (which implementation ran each stage; LLM(fast_paths=False) is the plain route):")
    print("  " + str(llm.engine.plan).replace("\n", "\n  "))
    print("\nNext: `make test`, then open notebooks/ (see the README).")
    return 0


def _info(args: argparse.Namespace) -> int:
    import os
    import platform

    import torch

    from . import __version__
    from .attention import triton_available

    print(f"minipaged {__version__}  python {platform.python_version()}  torch {torch.__version__}  ({platform.system()} {platform.machine()})")
    print(f"GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none (CPU only)'}")
    if triton_available():
        import triton

        mode = (
            "natively on the GPU"
            if torch.cuda.is_available()
            else "in Triton's interpreter on the CPU (minipaged sets TRITON_INTERPRET=1 when you pick attention='triton')"
        )
        print(f"triton {triton.__version__}: kernels run {mode}")
    else:
        print("triton: not installed (fine on macOS: attention='torch' is used)")
    print(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '(unset)')}")
    from .cpu import build
    from .plan import mkl_packing_available

    cinfo = build.info()
    if cinfo.get("why_not"):
        print(f"CPU kernels (minipaged/cpu): not built, every route stays on PyTorch: {cinfo['why_not']}")
    else:
        print(f"CPU kernels (minipaged/cpu): {cinfo['compiler']} {cinfo['flags']}; OpenMP "
              f"{'on' if cinfo['openmp'] else 'OFF (one core: the plan keeps PyTorch unless c_kernels=True)'}; "
              "GGUF matmul " + {"AMX tiles": "AVX-512 + AMX tiles past 8 rows (MINIPAGED_AMX=0: AVX-512 only)",
                                "AVX-512": "AVX-512"}.get(build.gguf_matmul_kernel(),
                                                          "portable loop only (the plan refuses it unless gguf_blocks=True)"))
    print("MKL packed weights (packed_gemm): " + ("available" if mkl_packing_available() else "not in this PyTorch"))
    print("Which fast path an engine takes is its plan: print(LLM().engine.plan); LLM(fast_paths=False) is the plain route.")
    try:
        from .model import default_model_path

        print(f"default model: {default_model_path()}")
    except Exception as e:  # noqa: BLE001 - shown to the user as is
        print(f"default model: missing ({e})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    ap = argparse.ArgumentParser(prog="minipaged", description="A small paged-attention LLM engine and its course.")
    ap.add_argument("--version", action="version", version=f"minipaged {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{demo,serve,bench,grade,info}")
    d = sub.add_parser("demo", help="serve several chat prompts at once with the default model and report what happened")
    d.add_argument("--model", default=None, help="a GGUF file or a local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    d.add_argument("--num-prompts", type=int, default=10)
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--max-num-seqs", type=int, default=64)
    d.add_argument("--attention", default="auto", choices=["auto", "torch", "triton"])
    d.set_defaults(fn=_demo)
    i = sub.add_parser("info", help="versions, GPU, Triton mode, where the default model is")
    i.set_defaults(fn=_info)

    from .bench.commands import add_bench_parser, add_module_command

    add_bench_parser(sub)
    try:
        from .server.cli import add_serve_parser
    except ImportError:
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub)
        from .server.proxy import add_proxy_parser

        add_proxy_parser(sub)  # disaggregated prefill: a prefill server, then a decode server
    add_module_command(sub, "grade", ".checks.grading", "grade a class's workbooks in a sandbox with the exercises' own checks")
    return ap


def main(argv: list[str] | None = None) -> int:
    from .bench.commands import dispatch
    from .cpu.build import show_notices

    show_notices()  # the kernels' build line on stderr, as a command-line tool should
    return dispatch(build_parser(), list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
