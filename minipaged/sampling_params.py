"""vLLM's module name for the request parameters: ``from minipaged.sampling_params import
SamplingParams, BeamSearchParams`` works as ``from vllm.sampling_params import ...`` does.
A re-export only: the classes live in sampling.py and beam_search.py."""
from .beam_search import BeamSearchParams
from .sampling import SamplingParams

__all__ = ["BeamSearchParams", "SamplingParams"]
