"""Generation engines behind one small interface (`Engine`): the embedded transformers engine and vLLM.
Both import their heavy dependency lazily."""
from .base import Engine, Generation
from .transformers_engine import TransformersEngine, sample_tokens
from .vllm_engine import VLLMEngine, vllm_available

__all__ = ["Engine", "Generation", "TransformersEngine", "VLLMEngine", "sample_tokens", "vllm_available"]
