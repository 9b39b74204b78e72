"""The built-in memory environment, its scripted expert, and its word-level tokenizer."""
from .memory import (MemoryEnv, ScriptedExpert, expert_rollouts, memory_config, memory_tokenizer)
from .models import tiny_llama
from .tokenizer import word_tokenizer

__all__ = ["MemoryEnv", "ScriptedExpert", "expert_rollouts", "memory_config", "memory_tokenizer", "tiny_llama",
           "word_tokenizer"]
