"""vLLM's ``vllm.sampling_params`` module: ``SamplingParams`` (minipaged.sampling, with the Sampler)
and ``StructuredOutputsParams`` (minipaged.structured_params), importable from one place as in vLLM."""
from .sampling import Logprob, SamplingParams, UnsupportedSamplingParam
from .structured_params import FORMS, GuidedDecodingParams, StructuredOutputsParams, check_grammar, choice_grammar, clean_backend_error

__all__ = ["SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "Logprob", "UnsupportedSamplingParam",
           "FORMS", "choice_grammar", "check_grammar", "clean_backend_error"]
