"""The Stateful pieces a checkpoint holds."""


def test_optimizer_group_names_stay_out_of_checkpoints_and_survive_loading():
    """A group's name picks its schedule: code, not state. Checkpoints written before groups
    had names load, and a loaded optimizer keeps its groups' names."""
    import torch

    from forja.checkpoint.states import OptimizerState
    from forja.models import build_model
    from forja.optim import build_optimizer
    from forja.optim.config import OptimConfig

    model = build_model("llama", "debug")
    opt = build_optimizer(model, OptimConfig())
    model(torch.randint(0, 100, (1, 8))).sum().backward()
    opt.step()
    saved = OptimizerState(model, opt).state_dict()
    assert saved and not any(k.startswith("param_groups.") and k.endswith(".name") for k in saved)
    fresh = build_optimizer(model, OptimConfig())
    OptimizerState(model, fresh).load_state_dict(saved)  # as a checkpoint from before names existed
    assert [g["name"] for g in fresh.param_groups] == ["matrices", "vectors"]


def test_which_update_a_group_takes_comes_from_the_code_not_the_checkpoint():
    """SOAP's `precondition` (and Muon's `use_muon`) say which update a group takes: a checkpoint
    written before SOAP left embeddings to Adam has no such flag, and still loads."""
    import torch

    from forja.checkpoint.states import OptimizerState
    from forja.models import build_model
    from forja.optim import build_optimizer
    from forja.optim.config import OptimConfig

    model = build_model("llama", "debug")
    cfg = OptimConfig(name="soap")
    opt = build_optimizer(model, cfg)
    model(torch.randint(0, 100, (1, 8))).sum().backward()
    opt.step()
    saved = OptimizerState(model, opt).state_dict()
    assert not any(k.startswith("param_groups.") and k.endswith(".precondition") for k in saved)
    fresh = build_optimizer(model, cfg)
    OptimizerState(model, fresh).load_state_dict(saved)
    assert {g["name"]: g["precondition"] for g in fresh.param_groups} == \
        {g["name"]: g["precondition"] for g in opt.param_groups}
