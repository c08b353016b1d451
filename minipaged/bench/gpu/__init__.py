"""The simulated GPU: the PagedAttention paper's experiments driven by the real scheduler and pool.

One concept per module: ``specs`` (GPUs and models, with sources), ``cost`` (KV room and
roofline step time), ``datasets`` (synthesized ShareGPT/Alpaca lengths), ``policies`` (the
baselines as reservation policies around any scheduler), ``simulator`` (the systems served on
``minipaged.bench.clock``'s loop, which also owns the Poisson arrivals), ``paper`` (Figs. 12
and 13, ``minipaged bench paper``) and ``sharing`` (§6.3-6.5: parallel sampling, beam search, a
shared prefix, a chatbot; ``minipaged bench paper --beam-width`` and the like).
"""
from ..clock import poisson_arrivals
from .cost import Calibration, StepCostModel, memory_plan
from .datasets import DATASETS, sample_lengths
from .policies import SYSTEMS, ReservingScheduler, Reservation
from .simulator import SimResult, build_scheduler, run
from .specs import GPUS, MODELS, get_gpu, get_model

__all__ = ["Calibration", "StepCostModel", "memory_plan", "DATASETS", "poisson_arrivals", "sample_lengths",
           "SYSTEMS", "ReservingScheduler", "Reservation", "SimResult", "build_scheduler", "run", "GPUS", "MODELS",
           "get_gpu", "get_model"]
