"""The built-in memory environment, its scripted expert, and its word-level tokenizer."""
from .memory import MemoryEnv, ScriptedExpert, expert_rollouts, memory_config, memory_tokenizer, summary_correct
from .models import tiny_llama
from .tokenizer import word_tokenizer

__all__ = ["MemoryEnv", "ScriptedExpert", "expert_rollouts", "memory_config", "memory_tokenizer", "summary_correct",
           "tiny_llama", "word_tokenizer"]
