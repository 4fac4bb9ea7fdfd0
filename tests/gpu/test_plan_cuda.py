"""forja plan's memory model on a GPU (skipped without one): one training step of a Llama in
bf16 autocast with fused AdamW, torch's allocator peak against the prediction."""

import pytest
import torch

from forja.models import build_model
from forja.optim import OptimizerGroup
from forja.optim.config import OptimConfig
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.memory import predict_memory
from forja.plan.shape import model_shape


@pytest.mark.parametrize("flavor,batch,seq", [("tiny", 8, 1024), ("3.2-1b", 2, 2048)])
def test_one_gpu_step_peak_is_predicted(flavor, batch, seq):
    device = torch.device("cuda")
    model = build_model("llama", flavor).to(device)
    optim = OptimizerGroup([model], OptimConfig())
    tokens = torch.randint(0, model.args.vocab_size, (batch, seq), device=device)

    def step():
        optim.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()

    step()  # the optimizer state exists from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    measured = torch.cuda.max_memory_allocated()
    job = Job(shape=model_shape(model.args, seq - 1), seq_len=seq - 1, global_batch_size=batch, gpu=True, bf16=True)
    predicted = predict_memory(job, Layout(micro_batch_size=batch)).total
    assert predicted / measured == pytest.approx(1.0, abs=0.2), (predicted, measured)
