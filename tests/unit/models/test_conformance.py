"""Every registered family against transformers, from the family's `CASE` (test_<family>.py):
checkpoints load into the same logits, save back bit-exact in the published layout and read
in transformers again; a flavor built by forja exports to transformers and back; greedy
decoding through forja's cache equals transformers' `generate`; published sizes equal
transformers' models built on the meta device; the fused-experts layout loads the same; and
what forja cannot represent is refused with the field named. A family's own behaviour is
tested in its file."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from safetensors.torch import load_file

from forja.errors import ForjaError
from forja.generate import SamplingConfig, generate
from forja.models import FAMILIES, build_model, load_hf_checkpoint, model_args, save_hf_checkpoint
from tests.helpers import max_logit_diff
from tests.unit.models.family_checks import (
    FamilyCase,
    FamilyCheckpoints,
    assert_greedy_equal,
    assert_same_weights,
    check_logits,
    check_save_round_trip,
    edited_checkpoint,
    float64_diffs,
    hf_meta_params,
    random_tokens,
    stored_names,
)

transformers = pytest.importorskip("transformers")


def _case(family: str) -> FamilyCase | None:
    """The family's CASE, from test_<family>.py; None when it has none."""
    module = f"tests.unit.models.test_{family}"
    try:
        return getattr(importlib.import_module(module), "CASE", None)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return None


CASES = {family: case for family in FAMILIES if (case := _case(family)) is not None}


def _params(what) -> list:
    """pytest params (family, item) over every case's `what(case)`, named family-item."""
    return [pytest.param(f, item, id=f"{f}-{item}") for f, case in CASES.items() for item in what(case)]


@pytest.fixture(scope="module")
def families(hf_store, tmp_path_factory) -> dict[str, FamilyCheckpoints]:
    return {f: FamilyCheckpoints(case, hf_store, tmp_path_factory) for f, case in CASES.items()}


def _tokens(model, n: int, seed: int = 1) -> torch.Tensor:
    """A (2, n) batch of random token ids of `model`'s vocabulary."""
    return random_tokens(n, seed, vocab_size=model.args.vocab_size)


def test_every_family_in_the_registry_has_a_case():
    assert sorted(CASES) == sorted(FAMILIES)  # a new family adds tests/unit/models/test_<family>.py with CASE


@pytest.mark.parametrize(("family", "name"), _params(lambda c: c.configs))
def test_load_matches_transformers_logits(families, monkeypatch, card, family, name):
    case, checkpoints = CASES[family], families[family]
    hf, model = checkpoints[name][1], checkpoints.loaded(name)
    tokens = _tokens(model, case.tokens)
    if case.logits is not None:  # its float64 comparison too
        diff, diff64 = case.logits(case, name, hf, model, tokens, monkeypatch)
        card(family, "float64", diff64)
    else:
        diff = check_logits(hf, model, tokens, case.tol, family=family, flavor=case.configs[name].flavor, label=name)
    card(family, "hf_load", diff)


@pytest.mark.parametrize("family", [f for f, case in CASES.items() if case.logits is None])
def test_float64_logits_match_transformers(families, card, family):
    """Both sides in float64 (deep copies of the first config's models), transformers' float32
    pieces the CASE names (float64_kept) in float64 as forja's are: what remains is the order
    of operations, within 1e-10 unless the CASE states a looser bound and says why."""
    case, checkpoints = CASES[family], families[family]
    name = next(iter(case.configs))
    hf, model = checkpoints[name][1], checkpoints.loaded(name)
    kept = getattr(hf.config, "_experts_implementation", None)
    hf.config._experts_implementation = "eager"  # transformers' grouped_mm has no float64
    try:
        diffs = float64_diffs(hf, model, _tokens(model, case.tokens), case)
    finally:  # the session's model is shared: later tests compare it as it was
        hf.config._experts_implementation = kept
    print(f"{family} {name}: float64 max |logit diff| = {diffs.float64:.3e}")
    card(family, "float64", diffs.float64)
    assert diffs.exact.abs().max() > 1.0  # logits of some size, not a degenerate model
    assert diffs.float64 < case.float64_tol


@pytest.mark.parametrize(("family", "name"), _params(lambda c: c.configs))
def test_save_round_trips_bit_exact_and_transformers_reads_it(families, tmp_path, card, family, name):
    case, checkpoints = CASES[family], families[family]
    path, model = checkpoints[name][0], checkpoints.loaded(name)
    out, reloaded = check_save_round_trip(model, tmp_path / "export", hf_class=case.configs[name].cls,
                                          tokens=_tokens(model, 33), tol=case.tol,
                                          layout_of=path if case.layout else None, stored=case.layout or stored_names)
    if case.same_tensors:  # forja writes back transformers' tensors as they were
        original, written = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
        assert sorted(written) == sorted(original)
        for key, t in original.items():
            assert torch.equal(written[key], t), key
    if case.after_round_trip is not None:
        case.after_round_trip(name, model, reloaded, checkpoints)
    card(family, "hf_save")


@pytest.mark.parametrize(("family", "flavor"), _params(lambda c: c.export_flavors))
def test_a_forja_model_exports_to_transformers_and_back(tmp_path, family, flavor):
    case = CASES[family]
    model = build_model(family, flavor, seed=3)
    if case.prepare_export is not None:
        case.prepare_export(model)
    save_hf_checkpoint(model, tmp_path / "a")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    diff = max_logit_diff(hf, model, _tokens(model, case.export_tokens))
    print(f"{family} {flavor} exported: max |logit diff| = {diff:.3e}")
    assert diff < (case.export_tol or case.tol)
    assert_same_weights(model, load_hf_checkpoint(tmp_path / "a"))


@pytest.mark.parametrize(("family", "name"), _params(lambda c: c.greedy))
def test_greedy_decoding_equals_transformers_generate(families, card, family, name):
    case, checkpoints = CASES[family], families[family]
    hf, model = checkpoints[name][1], checkpoints.loaded(name)
    prompt = _tokens(model, 9, seed=4)
    cached = assert_greedy_equal(hf, model, prompt, case.greedy[name])
    if case.uncached:
        uncached = generate(model, prompt, SamplingConfig(max_new_tokens=case.greedy[name]), use_cache=False)
        assert torch.equal(cached, uncached)
    card(family, "generate", case.greedy[name])


@pytest.mark.parametrize(("family", "flavor"), _params(lambda c: c.published))
def test_published_parameter_counts_equal_transformers(family, flavor):
    case = CASES[family]
    model = build_model(family, flavor, device="meta")
    counts = (model.num_params(), model.num_active_params(), model.num_active_params(exclude_embeddings=True))
    want = case.published[flavor]
    print(f"{family} {flavor}: {counts[:len(want)]}")
    assert counts[:len(want)] == want
    config = case.hf_config(flavor) if case.hf_config else FAMILIES[family].hf.config_from_args(model.args)
    assert model.num_params() == hf_meta_params(config)


@pytest.mark.parametrize(("family", "name"), _params(lambda c: c.fused))
def test_the_fused_expert_layout_loads_the_same(families, tmp_path, family, name):
    checkpoints = families[family]
    checkpoints[name][1].save_pretrained(tmp_path / "fused", save_original_format=False)  # transformers 5's own
    assert set(CASES[family].fused[name]) <= stored_names(tmp_path / "fused")
    assert_same_weights(load_hf_checkpoint(tmp_path / "fused"), checkpoints.loaded(name))  # fused, per expert


@pytest.mark.parametrize(("family", "index"), _params(lambda c: range(len(c.refusals))))
def test_an_unsupported_config_option_is_named(families, tmp_path, family, index):
    case = CASES[family]
    name, changes, message = case.refusals[index]
    dst = edited_checkpoint(families[family][name][0], tmp_path / "ckpt", **changes)
    with pytest.raises(ForjaError, match=case.refusal_prefix + message) as err:
        load_hf_checkpoint(dst)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("family", "index"), _params(lambda c: range(len(c.export_refusals))))
def test_export_refuses_what_transformers_cannot_express(tmp_path, family, index):
    overrides, message = CASES[family].export_refusals[index]
    model = build_model(family, CASES[family].refusal_flavor, device="meta", **overrides)
    with pytest.raises(ForjaError, match=message):
        save_hf_checkpoint(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_config_json_of_every_flavor_reads_back_into_its_args():
    """config_from_args then args_from_config is the identity on every flavor transformers can express."""
    for family, spec in FAMILIES.items():
        for flavor in spec.flavors:
            args = model_args(family, flavor)
            try:
                config = spec.hf.config_from_args(args)
            except ForjaError:  # a flavor transformers cannot express (DeepSeek-V2's routing)
                continue
            assert spec.hf.args_from_config(json.loads(json.dumps(config))) == args, (family, flavor)
