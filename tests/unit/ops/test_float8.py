"""float8 training through torchao, emulated on CPU."""

import pytest
import torch
from torch import nn

from forja.errors import ForjaError
from forja.models import build_model, model_args
from forja.models.common.tp_plan import dense_tp_plan, float8_styles
from forja.ops.float8 import apply_float8
from forja.parallel import ParallelConfig
from forja.parallel.checks import LayoutRequest, layout_errors

torchao = pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_model_trains_close_to_fp32(recipe):
    reference = build_model("llama", "debug", seed=0, tie_embeddings=False)
    model = build_model("llama", "debug", seed=0, tie_embeddings=False, device="meta")
    swapped = apply_float8(model, recipe, device=torch.device("cpu"), min_features=0)
    model.to_empty(device="cpu")
    model.init_weights(0)
    assert swapped == 4 * 7  # every block projection; the output projection stays
    assert isinstance(model.layers["0"].feed_forward.w2, Float8Linear) and type(model.output) is nn.Linear
    assert list(model.state_dict()) == list(reference.state_dict())  # same names: same checkpoints
    tokens, labels = torch.randint(0, 2048, (2, 32)), torch.randint(0, 2048, (2, 32))
    losses = []
    for m in (reference, model):
        loss = m(tokens, labels=labels)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], abs=2e-2)  # float8 rounding, not another model
    g_ref = reference.layers["1"].attention.wq.weight.grad
    g8 = model.layers["1"].attention.wq.weight.grad
    assert torch.nn.functional.cosine_similarity(g8.flatten(), g_ref.flatten(), dim=0) > 0.99


def test_small_layers_are_skipped():
    # debug Llama: wq/wo 128x128, wk/wv 128->64 (2 kv heads of 32), w1/w3 128->384, w2 384->128.
    def swapped(min_features):
        model = build_model("llama", "debug", device="meta")
        return apply_float8(model, "tensorwise", device=torch.device("cpu"), min_features=min_features)

    assert swapped(128) == 4 * 5  # wk and wv have 64 output features: too small


def test_float8_that_converts_no_layer_is_an_error():
    # The debug Llama's largest layers have 128 features on their smaller side.
    model = build_model("llama", "debug", device="meta")
    with pytest.raises(ForjaError, match=r"converts no Linear layer: the largest, layers\.0\.attention\.wq, has "
                                         r"128 input and 128 output .* train\.float8_min_features = 1024; set "
                                         r"train\.float8_min_features = 128"):
        apply_float8(model, "tensorwise", device=torch.device("cpu"), min_features=1024)


def test_tensor_parallel_plan_takes_float8_styles_for_converted_layers():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    model = build_model("llama", "debug", device="meta")
    apply_float8(model, "tensorwise", device=torch.device("cpu"), min_features=128)  # wk, wv stay (64 wide)
    plan = float8_styles(dense_tp_plan(sequence_parallel=True).block, model.layers["0"])
    assert type(plan["attention.wq"]) is Float8ColwiseParallel and type(plan["attention.wk"]) is ColwiseParallel
    assert type(plan["feed_forward.w2"]) is Float8RowwiseParallel
    assert plan["feed_forward.w2"].output_layouts == (Shard(1),)  # the layouts are kept
    # The MLP's input is gathered in float8 (w1 and w3 are float8); attention's is not (wk, wv are not).
    assert type(plan["feed_forward"]) is PrepareFloat8ModuleInput
    assert type(plan["attention"]) is PrepareModuleInput


def test_float8_with_tensor_parallelism_needs_tensorwise_scaling():
    def errors(recipe):
        request = LayoutRequest(args=model_args("llama", "debug"), parallel=ParallelConfig(tp=2, dp_shard=1),
                                world_size=2, seq_len=64, global_batch_size=2, micro_batch_size=1, float8=recipe)
        return [e for e in layout_errors(request) if "float8" in e]

    assert errors("tensorwise") == []
    assert errors("rowwise") == ["train.float8 = 'rowwise' with parallel.tp > 1 is not supported (torchao's float8 "
                                 "tensor-parallel styles scale tensorwise); set train.float8 = 'tensorwise', or "
                                 "parallel.tp = 1"]


def test_float8_styles_run_forward_and_backward_under_sequence_parallelism():
    """Gloo cannot gather float8, so the CPU parity runs (tests/distributed/test_float8_tp.py)
    take torch's styles under SP; here torch's fake process group (collectives that move
    nothing) runs the float8 styles' own path, float8 all-gathers included: its plumbing, not
    its numbers."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from forja import fallbacks
    from forja.models import spec_of
    from forja.parallel.tp import apply_tp, loss_context

    args = model_args("llama", "debug", tie_embeddings=False)
    model = build_model("llama", "debug", device="meta", tie_embeddings=False)
    apply_float8(model, "tensorwise", device=torch.device("cpu"), min_features=0)
    fallbacks.clear()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        apply_tp(model, init_device_mesh("cpu", (2,)), dataclasses.replace(spec_of(args).tp_plan(args, True),
                                                                          float8=True))
        model.to_empty(device="cpu")
        model.init_weights(0)
        tokens = torch.randint(0, args.vocab_size, (2, 64))
        with loss_context(2):
            model(tokens, labels=tokens).backward()
    finally:
        dist.destroy_process_group()
    assert [f.key for f in fallbacks.recorded()] == []  # the float8 styles, not the Gloo fallback
    w2 = model.layers["0"].feed_forward.w2
    assert isinstance(w2, Float8Linear) and isinstance(w2.weight.grad, DTensor)


def test_float8_emulated_off_a_gpu_is_in_the_fallback_record():
    """On a CPU torchao emulates float8 (slower than high precision): said, not silent."""
    from forja import fallbacks

    fallbacks.clear()
    apply_float8(build_model("llama", "debug", device="meta"), "tensorwise", device=torch.device("cpu"),
                 min_features=0)
    (entry,) = fallbacks.recorded()
    assert entry.key == "float8.emulated" and entry.asked == "train.float8 = 'tensorwise'"
    assert entry.why == "cpu has no float8 matmul"
    fallbacks.clear()
