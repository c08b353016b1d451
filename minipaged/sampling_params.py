"""vLLM's ``vllm.sampling_params`` module: ``SamplingParams`` (minipaged.sampling, with the Sampler),
``StructuredOutputsParams`` (minipaged.structured_params) and ``BeamSearchParams`` (minipaged.beam_search),
importable from one place as in vLLM. A re-export only."""
from .beam_search import BeamSearchParams
from .sampling import Logprob, SamplingParams, UnsupportedSamplingParam
from .structured_params import FORMS, GuidedDecodingParams, StructuredOutputsParams, check_grammar, choice_grammar, clean_backend_error

__all__ = ["SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "GuidedDecodingParams", "Logprob",
           "UnsupportedSamplingParam", "FORMS", "choice_grammar", "check_grammar", "clean_backend_error"]
