"""How a GPT-2 model is spread over ranks. Its module names match Llama's, so the same
steps apply; only the MLP (no w3) and the learned positions differ, which data
parallelism does not see."""

from forja.models.llama.parallelize import parallelize_llama as parallelize_gpt2

__all__ = ["parallelize_gpt2"]
