"""The simulated GPU: the PagedAttention paper's experiments driven by the real scheduler and pool.

One concept per module: ``specs`` (GPUs and models, with sources), ``cost`` (KV room and
roofline step time), ``datasets`` (synthesized ShareGPT/Alpaca lengths, Poisson arrivals),
``policies`` (the baselines as reservation policies around any scheduler), ``simulator``
(the clock) and ``paper`` (Figs. 12 and 13, ``minipaged bench paper``).
"""
from .cost import Calibration, StepCostModel, memory_plan
from .datasets import DATASETS, poisson_arrivals, sample_lengths
from .policies import SYSTEMS, ReservingScheduler, Reservation
from .simulator import SimResult, build_scheduler, run
from .specs import GPUS, MODELS, get_gpu, get_model

__all__ = ["Calibration", "StepCostModel", "memory_plan", "DATASETS", "poisson_arrivals", "sample_lengths",
           "SYSTEMS", "ReservingScheduler", "Reservation", "SimResult", "build_scheduler", "run", "GPUS", "MODELS",
           "get_gpu", "get_model"]
