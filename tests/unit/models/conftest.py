"""Random-weight Hugging Face models saved to disk: the reference for forja's families."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import save_hf_models

transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}

# name -> (model class, config kwargs). Small, but each exercises a feature of the family.
HF_CONFIGS = {
    # GQA 4:1, llama3 rope scaling (original context 32 < the test's 48 tokens), tied embeddings.
    "llama_gqa_scaled_tied": ("LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_theta=500_000.0, rope_scaling=LLAMA3_SCALING)),
    # Untied, plain RoPE with another theta, multi-head (no grouping), another eps.
    "llama_untied_theta": ("LlamaForCausalLM", dict(
        hidden_size=48, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=300, max_position_embeddings=128, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_theta=10_000.0)),
    # A head_dim that is not hidden_size / heads, and GQA 2:1.
    "llama_head_dim": ("LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=128,
        tie_word_embeddings=False, rope_theta=250_000.0)),
    "gpt2": ("GPT2LMHeadModel", dict(
        n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=128, bos_token_id=0, eos_token_id=0)),
}


def make_hf_model(name: str, seed: int = 0):
    cls_name, kwargs = HF_CONFIGS[name]
    cls = getattr(transformers, cls_name)
    config_cls = cls.config_class
    torch.manual_seed(seed)
    # A wider init than the default makes logits peaked, so greedy choices are not near-ties.
    config = config_cls(initializer_range=0.1, **kwargs)
    return cls(config).eval()


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """name -> (saved directory, the transformers model)."""
    return save_hf_models(tmp_path_factory, make_hf_model, HF_CONFIGS)
