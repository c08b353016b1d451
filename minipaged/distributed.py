"""Tensor parallelism over ``torch.distributed``: one scheduler, N workers, KV heads split.

Owns the sharding rule, the worker processes and the per-step messages. The engine keeps
everything else once, on the driver (rank 0): the scheduler, the block pool, the prefix cache,
the sampler. Every step the driver sends the runner's flat tensors (input ids, positions, slot
mapping, block tables, context lengths, query starts) and any copy-on-write pairs to every
worker; block ids are global, and each rank stores only its own KV heads for them.

The sharding (Megatron-LM's, as vLLM and nano-vllm do it):

- attention: rank r holds query heads ``[r H/N, (r+1) H/N)``; q, k, v are split by output
  columns, o_proj by input rows, and an all-reduce sums the N partial o_proj outputs;
- KV heads (grouped-query attention): split when ``num_kv_heads`` divides by N (rank r keeps
  ``H_kv/N`` heads); when N divides by ``num_kv_heads`` instead, each rank keeps the one KV head
  its query heads read (replicated on N/H_kv ranks); otherwise refused;
- MLP: gate and up split by output columns, down by input rows, then an all-reduce;
- embedding, norms and LM head: replicated. The head could be split by vocabulary, but only the
  driver samples, so it would need an all-gather of the logits each step; at the sizes this
  course serves, the replicated head costs less than that message (memory is the price).

Each rank runs the plain PyTorch model (model/llama.py) on its shard, with the all-reduces as
forward hooks on o_proj and down_proj. Processes: N - 1 workers started with the "spawn"
method, joined over gloo on a CPU (NCCL on CUDA), given their weights by the driver (so a model
built in memory works as well as a loaded one), stopped when the engine is shut down or
collected, or the interpreter exits. They are owned: each one watches its driver and exits the
moment the driver is gone (killed, crashed), and ignores Ctrl-C, which is the driver's to handle;
a Ctrl-C that interrupts the driver in the middle of a step (when the workers wait in an
all-reduce the driver will never reach) stops them at once instead of waiting for the collective
timeout. A worker that dies before it starts (a script without ``if __name__ == "__main__":``,
which "spawn" re-imports) is a clear error at once. Greedy tokens equal ``tensor_parallel_size=1``'s
except at near-ties, which the changed order of the sums can flip (tests/test_tensor_parallel.py).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .attention import AttentionMetadata, get_backend
from .kv_cache import KVCache

# Every collective (the step's message, each all-reduce) gives up after this long, so a worker that
# died or hangs never hangs the engine: the step fails with an error instead.
COLLECTIVE_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``size`` holds."""

    rank: int
    size: int
    heads: tuple[int, int]  # [first, last) query heads
    kv_heads: tuple[int, int]  # [first, last) KV heads
    inter: tuple[int, int]  # [first, last) MLP columns


def shard_rule(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> list[Shard]:
    """Every rank's slice; a ValueError naming the numbers where ``size`` cannot split the model."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")

    def fits(n: int) -> bool:
        return num_heads % n == 0 and intermediate_size % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)

    valid = [n for n in range(1, num_heads + 1) if fits(n)]
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {num_heads} attention heads: "
                         f"use one of {valid}")
    if intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the MLP width {intermediate_size}: use one of {valid}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} neither divides the {num_kv_heads} KV heads nor is a "
                         f"multiple of them, so the KV heads can be neither split nor replicated evenly: use one of {valid}")
    hq, group, inter = num_heads // size, num_heads // num_kv_heads, intermediate_size // size
    shards = []
    for r in range(size):
        q0, q1 = r * hq, (r + 1) * hq
        kv0, kv1 = q0 // group, (q1 - 1) // group + 1  # the KV heads these query heads read
        shards.append(Shard(r, size, (q0, q1), (kv0, kv1), (r * inter, (r + 1) * inter)))
    return shards


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> int:
    s = shard_rule(num_heads, num_kv_heads, intermediate_size, size)[0]
    return s.kv_heads[1] - s.kv_heads[0]


def shard_config(cfg: Any, shard: Shard) -> Any:
    return dataclasses.replace(cfg, num_heads=shard.heads[1] - shard.heads[0],
                               num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
                               intermediate_size=shard.inter[1] - shard.inter[0])


def shard_state(model: nn.Module, shard: Shard) -> dict[str, torch.Tensor]:
    """The rank's slice of every weight, in the model's own parameter names."""
    cfg = model.config
    D = cfg.head_dim
    q = slice(shard.heads[0] * D, shard.heads[1] * D)
    kv = slice(shard.kv_heads[0] * D, shard.kv_heads[1] * D)
    mlp = slice(*shard.inter)
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if ".q_proj." in name:
            t = t[q]
        elif ".k_proj." in name or ".v_proj." in name:
            t = t[kv]
        elif ".o_proj." in name:
            t = t[:, q]
        elif ".gate_proj." in name or ".up_proj." in name:
            t = t[mlp]
        elif ".down_proj." in name:
            t = t[:, mlp]
        out[name] = t.contiguous()
    return out


def build_shard_model(cfg: Any, state: dict[str, torch.Tensor], device: str = "cpu", stats: dict | None = None) -> nn.Module:
    """The plain model on one rank's shard, with an all-reduce after o_proj and down_proj.
    ``stats`` (optional) counts the all-reduces: calls, bytes and seconds spent in them."""
    from .model.llama import LlamaModel

    with torch.device("meta"):
        net = LlamaModel(cfg)
    net.load_hf_state_dict({("" if k.startswith("lm_head") else "model.") + k: v for k, v in state.items()})
    net = net.to(device).eval()
    hook = _all_reduce_hook if stats is None else _timed_all_reduce(stats)
    for layer in net.layers:
        for m in (layer.self_attn.o_proj, layer.mlp.down_proj):
            m.register_forward_hook(hook)
    return net


def _all_reduce_hook(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(out)  # the sum of every rank's partial product
    return out


def _timed_all_reduce(stats: dict):
    import time

    def hook(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        dist.all_reduce(out)  # waiting for the slowest rank is counted here too
        stats["seconds"] += time.perf_counter() - t
        stats["calls"] += 1
        stats["bytes"] += out.numel() * out.element_size()
        return out

    return hook


def _forward(model: nn.Module, kv_cache: KVCache, backend: Any, msg: dict) -> torch.Tensor:
    meta = AttentionMetadata(msg["slot_mapping"], msg["block_tables"], msg["context_lens"], msg["query_start_loc"],
                             msg["num_decodes"])
    if msg["blocks_to_copy"]:
        from .prefix_cache import copy_blocks

        copy_blocks(kv_cache, msg["blocks_to_copy"])
    return model(msg["input_ids"], msg["positions"], kv_cache, meta, backend)


def _watch_driver() -> None:
    """Exit this worker the moment its driver process is gone, however it went (SIGKILL, a crash):
    a daemon thread waits on the pipe that "spawn" keeps open to the parent, which the kernel
    closes when the parent dies. No polling, and it works while the main thread is blocked in a
    collective (those release the GIL)."""
    import multiprocessing
    import threading
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None or getattr(parent, "sentinel", None) is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(0)  # no cleanup to do: the driver, which owned the work, is gone

    threading.Thread(target=watch, name="minipaged-tp-watch-driver", daemon=True).start()


def _worker(rank: int, size: int, init: str, cfg: Any, num_blocks: int, block_size: int, dtype: torch.dtype,
            attention: str, backend_name: str, ready: Any = None, kv_cache_dtype: str = "auto",
            calculate_kv_scales: bool = False) -> None:
    import datetime
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches every process: the driver decides
    _watch_driver()
    if ready is not None:  # started (the main module re-imported without starting an engine of its own)
        ready.send(rank)
        ready.close()
    torch.set_num_threads(1)
    dist.init_process_group(backend_name, init_method=init, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        box = [None]
        dist.recv_object_list(box, src=0)  # this rank's weights
        model = build_shard_model(cfg, box[0])
        box = [None]
        kv = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype,
                     kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales)
        backend = get_backend(attention, "cpu")
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            msg = box[0]
            if msg is None:
                break
            with torch.inference_mode():
                _forward(model, kv, backend, msg)
    finally:
        dist.destroy_process_group()


def _wait_started(procs: list, readers: list, timeout: float) -> None:
    """Wait until every worker has said it started; a RuntimeError naming the worker if one died
    first (then every worker is stopped)."""
    import time
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout
    for rank, (proc, reader) in enumerate(zip(procs, readers), start=1):
        left = deadline - time.monotonic()
        got = wait([reader, proc.sentinel], timeout=max(0.0, left))
        started = reader in got
        if started:
            try:
                reader.recv()
            except EOFError:  # the worker closed its end by dying
                started = False
        if not started:
            proc.join(timeout=1)
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)
            if proc.exitcode is None:
                why = f"did not start within {timeout:.0f} s"
            else:
                why = f"exited with code {proc.exitcode} before it started"
            raise RuntimeError(
                f"tensor-parallel worker rank {rank} (pid {proc.pid}) {why}. Workers are started with the "
                f"'spawn' method, which re-imports your main script in each worker: a script that builds an "
                f"engine with tensor_parallel_size > 1 must do it under `if __name__ == \"__main__\":` "
                f"(its traceback, printed above, says more)")
        reader.close()


class _Group:
    """The driver's side of the process group; ``close`` stops every worker (idempotent).

    ``in_step`` is True while a step's collectives are under way: a close then (an exception or a
    Ctrl-C in the middle of a step, when the workers wait in an all-reduce the driver will never
    reach) cannot say goodbye through the group, so it stops the workers by signal at once."""

    def __init__(self, procs: list, init_file: str) -> None:
        self.procs, self.init_file, self.open, self.in_step = procs, init_file, True, False

    def close(self, abort: bool = False) -> None:
        if not self.open:
            return
        self.open = False
        abort = abort or self.in_step or not all(p.is_alive() for p in self.procs)
        if not abort:
            try:
                dist.broadcast_object_list([None], src=0)  # every worker leaves its loop
            except Exception:
                abort = True
        for p in self.procs:
            if abort and p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=2 if abort else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        try:
            os.unlink(self.init_file)
        except OSError:
            pass


class TensorParallelExecutor:
    """The executor of an engine with ``tensor_parallel_size`` > 1: the same face as
    executor.Executor (forward, greedy_tokens, compute_logits, prompt_logits, copy_blocks, plan,
    backend, last_route), with the driver's own shard computed here and the others in worker processes."""

    def __init__(self, config: Any, model: nn.Module, device: torch.device, attention: Any, kv_cache: KVCache) -> None:
        size = config.tensor_parallel_size
        if not isinstance(attention, str):
            raise ValueError("tensor_parallel_size > 1 takes attention by name ('auto', 'torch', 'reference', "
                             "'triton'): every worker process builds its own, and a function of yours cannot be sent to them")
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group is already running in this process: one "
                               "tensor-parallel engine per process (call engine.shutdown() on the other first)")
        most = max(8, 4 * (os.cpu_count() or 1))
        if size > most:
            raise ValueError(f"tensor_parallel_size={size} is more worker processes than this machine can usefully "
                             f"start ({os.cpu_count()} CPUs): use at most {most}")
        cfg = model.config
        shards = shard_rule(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, size)
        attention = "torch" if attention in ("auto", "cpu") else attention
        self.backend = get_backend(attention, device)
        self.model, self.kv_cache = model, kv_cache
        backend_name = "nccl" if device.type == "cuda" else "gloo"
        fd, init_file = tempfile.mkstemp(prefix="minipaged-tp-")
        os.close(fd)
        os.unlink(init_file)  # the file store creates it
        init = f"file://{init_file}"
        ctx = torch.multiprocessing.get_context("spawn")
        p = next(model.parameters())
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, size)]
        procs = [ctx.Process(target=_worker, daemon=True, name=f"minipaged-tp-rank{r}",
                             args=(r, size, init, shard_config(cfg, shards[r]), kv_cache.num_blocks, kv_cache.block_size,
                                   p.dtype, attention, backend_name, pipes[r - 1][1]),
                             kwargs={"kv_cache_dtype": kv_cache.kv_cache_dtype,  # 8-bit pages: each rank its own scales
                                     "calculate_kv_scales": config.calculate_kv_scales}) for r in range(1, size)]
        for proc, (_, writer) in zip(procs, pipes):
            proc.start()
            writer.close()  # the worker holds the only writing end: its death reads as EOF here
        _wait_started(procs, [reader for reader, _ in pipes], COLLECTIVE_TIMEOUT_S)
        import datetime

        dist.init_process_group(backend_name, init_method=init, rank=0, world_size=size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self._group = _Group(procs, init_file)
        self._finalizer = weakref.finalize(self, self._group.close)
        for s in shards[1:]:
            dist.send_object_list([shard_state(model, s)], dst=s.rank)
        self.all_reduce = {"calls": 0, "bytes": 0, "seconds": 0.0}  # the driver's all-reduces so far
        self.shard_model = build_shard_model(shard_config(cfg, shards[0]), shard_state(model, shards[0]), device.type,
                                             self.all_reduce)
        self._pending_copies: list = []
        self.last_route = None
        refused = {"fast_paths": f"tensor_parallel_size={size}: every rank runs the plain model on its shard, "
                                 "with two all-reduces per layer"}
        kv = shards[0].kv_heads[1] - shards[0].kv_heads[0]
        split = "split" if cfg.num_kv_heads % size == 0 else "replicated"
        from .model.llama import plain_ops
        from .plan import Plan, speculative_stage

        # every rank runs the plain table on its shard (its linear layers' hooks all-reduce)
        ops = plain_ops(self.backend).relabel(
            kv_write=f"{self.backend.name} on each rank's {kv} KV head(s) ({split})",
            decode_attention=f"{self.backend.name}, {shards[0].heads[1] - shards[0].heads[0]} query heads per rank",
            prefill_attention=f"{self.backend.name}, per rank",
            linear=f"torch, split over {size} ranks (q/k/v/gate/up by columns, o/down by rows + all-reduce)",
            elementwise="torch (replicated)")
        stages = {"whole_step_decode": "off (layer by layer)", "next_token": "sampler on the driver (LM head replicated)",
                  "prompt_logprobs": "one more pass of the prompt through the whole model on the driver (plain, "
                                     "a scratch cache)"}
        spec_route, limit = speculative_stage(config, device, "every rank's shard (a prefill-shaped step)")
        if spec_route is not None:
            stages["speculative"] = spec_route
        self.plan = Plan(ops, stages, refused, self.backend.name, attention=self.backend, speculative_batch_limit=limit)

    def copy_blocks(self, pairs: list) -> None:
        from .prefix_cache import copy_blocks

        copy_blocks(self.kv_cache, pairs)
        self._pending_copies.extend(pairs)  # the workers copy theirs with the next step's message

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not self._group.open:
            raise RuntimeError("this engine's tensor-parallel workers were shut down (a worker died, a step failed, "
                               "or engine.shutdown() was called): build a new engine")
        dead = [(r + 1, p.pid, p.exitcode) for r, p in enumerate(self._group.procs) if not p.is_alive()]
        if dead:
            self._group.close()
            raise RuntimeError("tensor-parallel worker(s) died: " + ", ".join(
                f"rank {r} (pid {pid}, exit code {code})" for r, pid, code in dead) + "; this engine serves no more: build a new one")
        msg = {"input_ids": input_ids, "positions": positions, "slot_mapping": meta.slot_mapping,
               "block_tables": meta.block_tables, "context_lens": meta.context_lens,
               "query_start_loc": meta.query_start_loc, "num_decodes": meta.num_decodes,
               "blocks_to_copy": self._pending_copies}
        self._pending_copies = []
        self._group.in_step = True
        try:
            dist.broadcast_object_list([msg], src=0)
            self.last_route = "tensor_parallel"
            hidden = self.shard_model(input_ids, positions, self.kv_cache, meta, self.backend)
        except BaseException:
            # an error or a Ctrl-C mid-step: the workers may be waiting in an all-reduce this rank
            # will never reach, so the group cannot go on in step; it is stopped now (not after the
            # collective timeout), and later steps say so
            self._group.close(abort=True)
            raise
        self._group.in_step = False
        return hidden

    def greedy_tokens(self, hidden: torch.Tensor) -> None:
        return None

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shard_model.compute_logits(hidden)

    @torch.no_grad()
    def prompt_logits(self, token_ids: list[int], block_size: int) -> torch.Tensor:
        """prompt_logprobs' pass: the whole model on the driver, plain, into a scratch cache."""
        from .executor import scratch_pass

        ids, positions, cache, meta = scratch_pass(self.model, token_ids, block_size, self.kv_cache.k[0].device)
        return self.model.compute_logits(self.model(ids, positions, cache, meta))

    def weight_bytes_read(self) -> None:
        return None

    def close(self) -> None:
        self._finalizer()


__all__ = ["Shard", "shard_rule", "kv_heads_per_rank", "shard_config", "shard_state", "build_shard_model",
           "TensorParallelExecutor", "cleanup_dist_env_and_memory"]


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's clean-up between engines in one script: free what the last engine left (Python's
    garbage, then the GPU's cached blocks where there is a GPU). minipaged keeps no process group
    in the driver (tensor-parallel workers end with their executor's ``close()``) and never
    uses Ray, so ``shutdown_ray`` changes nothing."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
