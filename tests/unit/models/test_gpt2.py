"""GPT-2 against transformers: the conformance CASE (Conv1D weights transposed, the fused
q/k/v projection split in three, learned positions, tied embeddings). Its published sizes
are checked there; its bad checkpoints in test_hf.py."""

from __future__ import annotations

from tests.unit.models import family_checks as checks

CASE = checks.FamilyCase(
    family="gpt2",
    configs={"gpt2": checks.HFConfig("GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=300,
                                                       n_positions=128, bos_token_id=0, eos_token_id=0))},
    # A few times what is measured (transformers 5.24, torch 2.13, CPU): 1.4e-6 at most, its
    # q/k/v coming out of one fused projection there, three here.
    tol=5e-6,
    layout=checks.stored_names, greedy={"gpt2": 32}, uncached=True,
    # Counts of the released checkpoints (tied weights once).
    published={"124m": (124_439_808,), "350m": (354_823_168,), "774m": (774_030_080,), "1.5b": (1_557_611_200,)},
)
