"""Every family's card, the layouts no other parity test covers: each family's debug flavor
under FSDP 2, PP 2, both kinds of CP 2 and (with experts) EP 2 reproduces its single-process
losses (CPU, Gloo, fp32, PARITY_STEPS steps), and a run stopped halfway resumes bit for bit.
A layout a family's blocks cannot take yet is refused by the preflight in one sentence, and
that refusal is the cell. The layouts train one after another in one shared group of 2 ranks.
Which test covers the other cells is named in COVERED (scripts/model_cards.py fails on a cell
no test covers)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from forja.cli import main
from forja.models import FAMILIES, model_args
from tests.distributed.parity import (
    COMMON,
    MOE_TOL,
    PARITY_STEPS,
    ROUTED_CP_TOL,
    SAVE_HALFWAY,
    SharedLayouts,
    max_difference,
)
from tests.integration.conftest import losses, train_args

RING, A2A = {"parallel.cp_kind": '"ring"'}, {"parallel.cp_kind": '"all-to-all"'}
# Half the parity harness's batch and length: 62 layouts and 17 references at its size cost
# minutes; 2 micro-batches of 2 rows still give every layout (dp 2, 2 stages, 2 cp ranks) its share.
SMALL = {"train.global_batch_size": "4", "train.seq_len": "32"}
LAYOUTS = {  # card column -> the layout's keys, on 2 ranks
    "fsdp": {"parallel.dp_shard": "2"},
    "pp": {"parallel.pp": "2", "parallel.dp_shard": "1"},
    "cp_all_to_all": {**A2A, "parallel.cp": "2", "parallel.dp_shard": "1"},
    "cp_ring": {**RING, "parallel.cp": "2", "parallel.dp_shard": "1"},
    "ep": {"parallel.ep": "2", "parallel.dp_shard": "2"},
    "tp_sp": {"parallel.tp": "2", "parallel.dp_shard": "1"},  # here only where refused: test_tp_families.py runs TP
}
# (family, column) -> the test that fills that cell elsewhere.
COVERED = {
    **{("llama", c): "test_parity.py, test_parity_pp.py, test_parity_cp.py" for c in ("fsdp", "pp", "cp_all_to_all",
                                                                                     "cp_ring")},
    ("llama", "resume"): "integration/test_train.py (kill -9, then resume)",
    ("qwen3", "fsdp"): "test_parity_moe.py (EP 2 within FSDP 2)", ("qwen3", "ep"): "test_parity_moe.py",
    ("qwen3", "pp"): "test_parity_moe.py (PP 2 x EP 2)",
    **{("deepseek_v3", c): "test_parity_moe.py, test_parity_cp.py, test_parity_hybrid.py"
       for c in ("fsdp", "ep", "pp", "cp_all_to_all", "cp_ring")},
    **{("qwen3_5", c): "test_parity_hybrid.py, test_parity_cp.py" for c in ("fsdp", "pp", "ep", "cp_ring", "resume")},
    ("gpt_oss", "cp_ring"): "test_parity_cp.py",
    ("gemma3", "fsdp"): "test_parity_hybrid.py (FSDP 2 x TP 2)",
    ("olmo_hybrid", "pp"): "test_parity_hybrid.py",
}


def _flavor(family: str) -> str:
    """The debug flavor with experts where the family has one (qwen3's debug-moe), else debug."""
    flavors = FAMILIES[family].flavors
    return next((f for f in flavors if f.startswith("debug") and flavors[f].get("n_experts")), "debug")


def _has_experts(family: str) -> bool:
    return bool(FAMILIES[family].flavors[_flavor(family)].get("n_experts"))


def _model(family: str) -> dict[str, str]:
    """The family's run: its debug flavor, document masks off where its blocks cannot keep
    documents apart, on one rank or (the card's CP cells, one reference for every cell) over several."""
    one_document = bool({"documents", "cp_documents"} & set(model_args(family, _flavor(family)).layout_limits()))
    return {**SMALL, "model.family": f'"{family}"', "model.flavor": f'"{_flavor(family)}"',
            **({"model.document_mask": "false"} if one_document else {})}


def _axis(column: str) -> str:
    return "cp" if column.startswith("cp_") else column.split("_")[0]  # tp_sp -> tp


def _refused(family: str, column: str) -> bool:
    """A cell of an axis the family's blocks cannot take yet (its args' `layout_limits`): refused in the preflight."""
    return _axis(column) in model_args(family, _flavor(family)).layout_limits()


def _cells() -> list[tuple[str, str]]:
    columns = [*LAYOUTS, "resume"]
    return [(f, c) for f in FAMILIES for c in columns
            if (f, c) not in COVERED and (c != "ep" or _has_experts(f)) and (c != "tp_sp" or _refused(f, c))
            and (c != "fsdp" or not _has_experts(f) or _refused(f, "ep"))]  # EP 2 is within FSDP 2


CELLS = _cells()


@pytest.fixture(scope="module")
def references(tmp_path_factory, train_data):
    """family -> its single-process run (its halfway checkpoint kept), trained once when first asked for."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            run = tmp_path_factory.mktemp(f"ref-{family}") / "run"
            assert main(train_args(run, train_data, **{**COMMON, **SAVE_HALFWAY, **_model(family)})) == 0
            cache[family] = run
        return cache[family]

    return get


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory, train_data, request):
    """The selected cells' layouts (`-k llama4` trains llama4's alone), in one group."""
    chosen = {tuple(item.callspec.params[k] for k in ("family", "column")) for item in request.session.items
              if item.originalname == "test_family_layout_matches_single_process"}
    layouts = {f"{family} {column}": (2, {**_model(family), **LAYOUTS[column]})
               for family, column in CELLS
               if column != "resume" and not _refused(family, column) and (family, column) in chosen}
    return SharedLayouts(tmp_path_factory, train_data, layouts)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "column"), CELLS, ids=[f"{f}-{c}" for f, c in CELLS])
def test_family_layout_matches_single_process(family, column, tmp_path, train_data, references, shared_runs, card,
                                              capsys):
    if _refused(family, column):  # one sentence from the preflight, before torchrun starts
        args = train_args(tmp_path / "run", train_data, **{**COMMON, **_model(family), **LAYOUTS[column]})
        assert main(args + ["--nproc", "2"]) == 2
        assert f"do not support yet; set parallel.{_axis(column)} = 1" in capsys.readouterr().err
        card(family, column, "refused")
        return
    reference = losses(references(family))
    if column == "resume":
        run = tmp_path / "run"
        shutil.copytree(references(family), run)
        shutil.rmtree(run / "checkpoints" / f"step-{PARITY_STEPS:08d}")  # as if stopped halfway
        assert main(train_args(run, train_data, **{**COMMON, **SAVE_HALFWAY, **_model(family)})) == 0
        diff = max_difference(reference, losses(run))
        card(family, column, diff)
        assert diff == 0.0  # bit for bit
        return
    got = losses(shared_runs.run(f"{family} {column}", tmp_path / "run"))
    diff = max_difference(reference, got)
    print(f"parity {family} {column}: max |loss diff| = {diff:.2e}")
    card(family, column, diff)
    if column == "ep":  # the other parameters are sharded by FSDP 2 in the same run
        card(family, "fsdp", diff)
    if column.startswith("cp_") and _has_experts(family):  # a router's near tie may flip (ROUTED_CP_TOL)
        assert abs(got[1] - reference[1]) < MOE_TOL and diff < ROUTED_CP_TOL, (reference, got)
    else:
        assert diff < MOE_TOL
