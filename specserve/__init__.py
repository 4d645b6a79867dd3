"""specserve: an LLM inference engine built around speculative decoding."""

from specserve.sampling.params import SamplingParams
from specserve.sampling.structured import Structural, StructuredOutputsParams

__all__ = ["AsyncEngine", "LLM", "SamplingParams", "Structural", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily so `specserve --help` stays fast
        from specserve.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from specserve.clients.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
