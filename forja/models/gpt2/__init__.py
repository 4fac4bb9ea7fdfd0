"""GPT-2: `model.py` the model, `hf.py` its checkpoints, `parallelize.py` its TP plan.

Published GPT-2 sizes (OpenAI's released checkpoints), plus small ones for tests."""

from forja.models.gpt2.hf import ADAPTER
from forja.models.gpt2.model import GPT2, GPT2Args
from forja.models.gpt2.parallelize import gpt2_tp_plan
from forja.models.spec import ModelSpec

_GPT2 = dict(vocab_size=50_257, max_seq_len=1024, norm_eps=1e-5)

FLAVORS: dict[str, dict] = {
    # ~1M parameters: unit tests and parity runs.
    "debug": dict(dim=128, n_layers=4, n_heads=4, ffn_dim=512, vocab_size=2048, max_seq_len=512),
    # ~10M parameters.
    "tiny": dict(dim=256, n_layers=8, n_heads=8, ffn_dim=1024, vocab_size=8192, max_seq_len=1024),
    "124m": dict(dim=768, n_layers=12, n_heads=12, ffn_dim=3072, **_GPT2),
    "350m": dict(dim=1024, n_layers=24, n_heads=16, ffn_dim=4096, **_GPT2),
    "774m": dict(dim=1280, n_layers=36, n_heads=20, ffn_dim=5120, **_GPT2),
    "1.5b": dict(dim=1600, n_layers=48, n_heads=25, ffn_dim=6400, **_GPT2),
}

SPEC = ModelSpec("gpt2", GPT2, GPT2Args, FLAVORS, ADAPTER, tp_plan=gpt2_tp_plan)
