"""The seed's scenario through the simulated GPU: a 7B model, a 40 GB GPU, 2,048-token sequences.

Owns one check: the figures the course started from (the design notes' SEED_CLAIMS.md: an
explainer page's 14 GB of weights, ~24 GB of KV room, 9 contiguous against 24 paged
sequences, and 840 / 1,820 / 2,576 tok/s for naive, static and continuous serving), each set
beside what the same cost model, scheduler and pool give for Llama-2-7B on an A100-40GB, with
a verdict (reproduced, corrected or unreachable) and the reason.

The page gives no workload. Two are served, saturating the GPU (every request arrives at once,
so the tok/s is the most each way of serving gives, not a latency-bound figure):

* ``full``: every request is a 2,048-token sequence (1,024 prompt + 1,024 output tokens),
  the page's wording taken literally;
* ``sharegpt``: the paper's ShareGPT lengths cut to 2,048 (mean 161 in, 338 out).

Serving: ``naive`` one request at a time (no batching); ``static`` request-level batches, each
request holding a contiguous 2,048-token reservation (FasterTransformer's way); ``continuous``
iteration-level batching over 16-token pages (vLLM's way).
"""
from __future__ import annotations

from dataclasses import dataclass

from .cost import DEFAULT_CALIBRATION, StepCostModel, memory_plan
from ..clock import poisson_arrivals
from .datasets import sample_lengths
from .policies import Reservation, ReservingScheduler
from .simulator import build_scheduler, run
from .specs import get_gpu, get_model

GPU, MODEL, MAX_LEN = "a100-40gb", "llama-2-7b", 2048
# The page's figures (SEED_CLAIMS.md rows 1-5 and 7).
SEED = {"weights_gb": 14.0, "kv_gb": 24.0, "contiguous_seqs": 9, "paged_seqs": 24,
        "naive_tok_s": 840.0, "static_tok_s": 1820.0, "continuous_tok_s": 2576.0}


def _requests(workload: str, n: int, seed: int = 0) -> list[tuple[int, int]]:
    if workload == "full":
        return [(MAX_LEN // 2, MAX_LEN // 2)] * n
    if workload == "sharegpt":
        return sample_lengths("sharegpt", n, max_len=MAX_LEN, seed=seed)
    raise ValueError(f"unknown workload {workload!r}: full or sharegpt")


def _scheduler(way: str, kv_tokens: int):
    if way == "continuous":
        return build_scheduler("vllm", kv_tokens, 16, MAX_LEN)
    if way == "static":
        return build_scheduler("fastertransformer", kv_tokens, 16, MAX_LEN)
    if way == "naive":  # request-level, one at a time
        inner = build_scheduler("vllm", kv_tokens + MAX_LEN, 16, MAX_LEN)
        return ReservingScheduler(inner, Reservation("max"), kv_tokens, MAX_LEN, static=True, max_batch=1)
    raise ValueError(f"unknown way of serving {way!r}: naive, static or continuous")


@dataclass
class Served:
    way: str
    workload: str
    tokens_per_s: float  # output tokens per second, the whole run
    mean_batch: float  # sequences per step
    max_batch: int


def serve(way: str, workload: str, n: int = 400, seed: int = 0) -> Served:
    """``n`` requests of ``workload`` arriving at once, served ``way`` on the simulated A100-40GB."""
    plan = memory_plan(GPU, MODEL)
    reqs = _requests(workload, n, seed)
    arr = poisson_arrivals(n, 1e9, seed)
    r = run(_scheduler(way, plan.kv_tokens), reqs, arr, StepCostModel(GPU, MODEL, DEFAULT_CALIBRATION), way,
            keep_batches=True)
    steps = r.batch_sizes
    return Served(way, workload, r.throughput_tokens, sum(steps) / len(steps), max(steps))


def bandwidth_bound_tok_s(batch: int = 1, context: int = MAX_LEN // 2) -> float:
    """The most tokens per second a decode step of ``batch`` sequences can give on the A100 if
    it only had to read the weights and the KV at the datasheet's full bandwidth (no overhead,
    100% efficiency): a hard ceiling, whatever the software."""
    g, m = get_gpu(GPU), get_model(MODEL)
    nbytes = m.weight_bytes_read_per_step + batch * context * m.kv_bytes_per_token
    return batch * g.bandwidth / nbytes


def seed_scenario(n: int = 400, seed: int = 0) -> dict:
    """Every seed figure beside the simulated one, with a verdict and its reason."""
    plan = memory_plan(GPU, MODEL)
    m = get_model(MODEL)
    served = {(w, wl): serve(w, wl, n, seed) for wl in ("full", "sharegpt") for w in ("naive", "static", "continuous")}
    contiguous = plan.kv_tokens // MAX_LEN
    per_seq_gb = MAX_LEN * m.kv_bytes_per_token / 1e9
    ceiling = bandwidth_bound_tok_s(1)
    rows = [
        {"claim": "model weights (GB)", "seed": SEED["weights_gb"], "simulated": m.weight_bytes / 1e9,
         "verdict": "reproduced", "why": "6.74e9 parameters x 2 bytes (fp16) = 13.5 GB, the page rounds up"},
        {"claim": "KV room (GB)", "seed": SEED["kv_gb"], "simulated": plan.kv_bytes / 1e9,
         "verdict": "reproduced", "why": "90% of 40 GiB, less weights and a 0.25 GB activation reserve: "
                                         f"{plan.kv_tokens:,} token slots of {m.kv_bytes_per_token / 1024:.0f} KiB"},
        {"claim": "contiguous sequences (2,048 reserved each)", "seed": SEED["contiguous_seqs"],
         "simulated": contiguous, "verdict": "corrected",
         "why": f"a 2,048-token sequence holds {per_seq_gb:.2f} GB of KV, so {plan.kv_bytes / 1e9:.1f} GB holds "
                f"{contiguous} whole reservations; 9 is 24 x 40%, the page's assumed 60% waste, not a count"},
        {"claim": "paged sequences, all 2,048 tokens long", "seed": SEED["paged_seqs"],
         "simulated": served[("continuous", "full")].mean_batch, "verdict": "corrected",
         "why": f"sequences that grow to 2,048 tokens fill their pages: paging holds more than the {contiguous} "
                f"reservations only while they are short (up to {served[('continuous', 'full')].max_batch}, then it "
                "preempts); 24 is 24 GB / 1 GB, the count with no waste at all"},
        {"claim": "paged sequences, ShareGPT lengths", "seed": SEED["paged_seqs"],
         "simulated": served[("continuous", "sharegpt")].mean_batch, "verdict": "corrected (more)",
         "why": "where paging pays: sequences are ~500 tokens on average, so pages hold several times "
                f"the {contiguous} contiguous reservations (the scheduler's cap is 256)"},
        {"claim": "naive serving (tok/s)", "seed": SEED["naive_tok_s"],
         "simulated": served[("naive", "full")].tokens_per_s, "verdict": "unreachable",
         "why": f"one sequence per step must read all 13.5 GB of weights per token: at the A100's 1,555 GB/s "
                f"datasheet bandwidth that is at most {ceiling:.0f} tok/s; 840 needs 7x the bandwidth"},
    ]
    for way in ("static", "continuous"):
        full, share = served[(way, "full")], served[(way, "sharegpt")]
        rows.append({"claim": f"{way} batching (tok/s)", "seed": SEED[f"{way}_tok_s"],
                     "simulated": full.tokens_per_s, "simulated_sharegpt": share.tokens_per_s,
                     "verdict": "corrected",
                     "why": f"batches of {full.mean_batch:.0f} (2,048-token sequences) / {share.mean_batch:.0f} "
                            "(ShareGPT) sequences share each read of the weights"})
    st_full, co_full = served[("static", "full")].tokens_per_s, served[("continuous", "full")].tokens_per_s
    st_sh, co_sh = served[("static", "sharegpt")].tokens_per_s, served[("continuous", "sharegpt")].tokens_per_s
    rows.append({"claim": "continuous / static", "seed": SEED["continuous_tok_s"] / SEED["static_tok_s"],
                 "simulated": co_full / st_full, "simulated_sharegpt": co_sh / st_sh, "verdict": "corrected",
                 "why": "with equal 2,048-token sequences both ways hold about the same batch: little gain; with "
                        "ShareGPT's varied lengths the paged, iteration-level batch is several times larger"})
    return {"gpu": GPU, "model": MODEL, "max_len": MAX_LEN, "requests": n, "rows": rows,
            "served": {f"{w}/{wl}": s.__dict__ for (w, wl), s in served.items()},
            "naive_bandwidth_ceiling_tok_s": ceiling}


def format_seed_table(res: dict) -> str:
    lines = [f"The seed's scenario: {res['model']} on {res['gpu']}, {res['max_len']:,}-token sequences "
             f"(simulated, {res['requests']} requests at once)",
             f"{'claim':<44} {'seed':>8} {'simulated':>10} {'ShareGPT':>9}  verdict"]
    for r in res["rows"]:
        sh = r.get("simulated_sharegpt")
        lines.append(f"{r['claim']:<44} {r['seed']:>8.4g} {r['simulated']:>10.4g} "
                     f"{(f'{sh:.4g}' if sh is not None else '-'):>9}  {r['verdict']}: {r['why']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_seed_table(seed_scenario()))
