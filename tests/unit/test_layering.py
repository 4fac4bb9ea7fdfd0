"""Rule 1 of docs/architecture.md: imports run one way.

Each package may import only the layers below it (LAYERS); inside forja.train and forja.data
the floors read from the folder names run one way too (FLOORS); the graph of forja's modules
has no cycle (a cycle hidden behind a function-level or TYPE_CHECKING import still
couples the modules, so those count too). Each rule is its own test case, and the last
tests show that the checker catches a violation.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import forja

ROOT = Path(forja.__file__).parent
BASE = {"forja", "forja.errors", "forja.versions", "forja.files", "forja.names", "forja.fallbacks", "forja.eager",
        "forja.host", "forja.metric_names"}  # metric_names: made by train, read by metrics and report

# What each part of forja may import besides itself and BASE, lowest layer first.
LAYERS: dict[str, set[str]] = {
    "forja.storage": set(),  # object-store URLs; every layer may use it (see allowed)
    "forja.ops": set(),
    "forja.models": {"forja.ops"},  # single-device code; a family's TP plan is data
    "forja.data": set(),  # knows nothing of models, parallelism or training
    "forja.optim": set(),
    "forja.metrics": set(),
    "forja.parallel": {"forja.models", "forja.ops"},  # applies plans to models; never imports train
    "forja.checkpoint": {"forja.models", "forja.ops", "forja.data", "forja.parallel"},
    "forja.generate": {"forja.models", "forja.ops", "forja.data", "forja.checkpoint", "forja.parallel"},
    "forja.report": set(),
    # scores a loaded model on task files; loads it through checkpoint (a run) or models (a HF dir)
    "forja.eval": {"forja.models", "forja.ops", "forja.data", "forja.checkpoint", "forja.parallel", "forja.generate"},
    # predicts a layout's memory and speed from the model and the config; builds nothing
    "forja.plan": {"forja.models", "forja.ops", "forja.parallel", "forja.config"},
    "forja.train": {"forja.models", "forja.ops", "forja.data", "forja.optim", "forja.metrics", "forja.parallel",
                    "forja.checkpoint", "forja.generate", "forja.config", "forja.plan", "forja.eval"},
    "forja.sweep": {"forja.config"},  # launches `forja train` as a child process, never imports it
    "forja.cli": {"*"},
    "forja.__main__": {"forja.cli"},
    "forja.testing": set(),
}
# forja.config gathers the sections of a run's config, each owned by its component.
CONFIG_SECTIONS = {"forja.checkpoint.config", "forja.data.config", "forja.eval.config", "forja.metrics.config",
                   "forja.models.config", "forja.optim.config", "forja.parallel.config", "forja.train.config",
                   "forja.train.ft.config"}


# Inside a package, its floors, lowest first (the map in its __init__.py): a module may import
# its own floor and those below it, never one above. Each name is a module or sub-package of
# the package; the package's own __init__ (its public names) stands above every floor.
FLOORS: dict[str, list[tuple[str, ...]]] = {
    "forja.train": [
        ("config",),  # [run], [train], [debug]: values, and the drill grammar they are checked with
        ("step", "build"),  # how one step runs; the one build order of the model
        ("resilience",),  # health, recovery, drills, the watchdog: they act on a step's outcome
        ("ft",),  # replica groups: a group's manager uses the watchdog's restart count
        ("rehearse",),  # a run's build and one step on fake devices, beside the planner's prediction
        ("launch",),  # before the loop: preflight, run directory, the run's data, the launch of ft groups
        ("trainer", "callbacks", "evaluation", "probes"),  # the loop and what only it uses
        ("cli",),  # `forja train`: the preflight, then the trainer, torchrun or ft groups
    ],
    "forja.data": [
        ("config",),  # [data], read by both sides
        ("corpus",),  # preparation, torch-free: never imports the loader
        ("load",),  # the loader (torch): reads the prepared corpus
    ],
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(path: Path, known: dict[str, Path] = MODULES) -> set[str]:
    """The forja modules `path` imports, anywhere in the file; `from pkg import sub`
    counts as importing the submodule when `sub` is one."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(known)
            found |= subs or {node.module}
    return {m for m in found if m == "forja" or m.startswith("forja.")}


def owner(module: str) -> str:
    """The part of forja (a key of LAYERS, or a base module) that `module` belongs to."""
    if module in BASE or module == "forja.config":
        return module
    return next(layer for layer in LAYERS if module == layer or module.startswith(layer + "."))


def floor(module: str) -> tuple[str, int] | None:
    """(package of FLOORS, the floor `module` is on), or None outside those packages. The
    package itself is above its floors (importing it from inside imports all it exports)."""
    for package, floors in FLOORS.items():
        if module == package:
            return package, len(floors)
        if module.startswith(package + "."):
            name = module.removeprefix(package + ".").split(".")[0]
            level = next((i for i, names in enumerate(floors) if name in names), None)
            if level is None:
                raise ValueError(f"{module} is on no floor of {package}: give it one in FLOORS")
            return package, level
    return None


def allowed(importer: str, imported: str) -> bool:
    if imported in BASE or owner(imported) == "forja.storage":
        return True
    if importer == "forja.config":
        return imported in CONFIG_SECTIONS
    part, target = owner(importer), owner(imported)
    if part == target:
        return floor_allowed(importer, imported)
    return "*" in LAYERS[part] or target in LAYERS[part]


def floor_allowed(importer: str, imported: str) -> bool:
    """Inside one package of FLOORS, an import stays on its floor or goes down."""
    here, there = floor(importer), floor(imported)
    if here is None or there is None or here[0] != there[0]:
        return True
    return there[1] <= here[1]


def violations(part: str) -> list[tuple[str, str]]:
    return sorted((m, i) for m, p in MODULES.items() if owner(m) == part for i in imports(p)
                  if not allowed(m, i))


def test_every_module_belongs_to_a_layer():
    assert {owner(m) for m in MODULES} <= set(LAYERS) | BASE | {"forja.config"}


def test_every_module_of_a_layered_package_is_on_a_floor():
    for package, floors in FLOORS.items():
        names = {name for names in floors for name in names}
        for module in (m for m in MODULES if m.startswith(package + ".")):
            assert module.removeprefix(package + ".").split(".")[0] in names, module


def floor_violations(package: str, level: int) -> list[tuple[str, str]]:
    return sorted((m, i) for m, p in MODULES.items() if floor(m) == (package, level) for i in imports(p)
                  if not floor_allowed(m, i))


@pytest.mark.parametrize(("package", "level"), [(p, i) for p, floors in FLOORS.items() for i in range(len(floors))],
                         ids=[f"{p}.{'/'.join(names)}" for p, floors in FLOORS.items() for names in floors])
def test_floors_inside_a_package_import_only_those_below(package, level):
    assert floor_violations(package, level) == []


@pytest.mark.parametrize("part", sorted(set(LAYERS) | {"forja.config"} | BASE))
def test_imports_run_one_way(part):
    assert violations(part) == []


def test_base_modules_import_no_other_layer():
    for name in BASE:
        assert imports(MODULES[name]) <= BASE, name
    for name in (m for m in MODULES if owner(m) == "forja.storage"):  # storage: only base and itself
        assert {owner(i) for i in imports(MODULES[name])} <= BASE | {"forja.storage"}, name


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules():
    graph = {m: imports(p) & set(MODULES) for m, p in MODULES.items()}
    assert cycles(graph) == []


# -- the checker itself ------------------------------------------------------------------------
@pytest.mark.parametrize(("importer", "imported"), [
    ("forja.models.llama.model", "forja.parallel.fsdp"),
    ("forja.ops.rope", "forja.models.common.rope"),
    ("forja.parallel.pp", "forja.train.step.engine"),
    ("forja.data.load.loader", "forja.models"),
    ("forja.checkpoint.manager", "forja.train.trainer"),
    ("forja.config", "forja.train.trainer"),
    # inside train/: a floor imports none above it
    ("forja.train.config", "forja.train.resilience.drills"),
    ("forja.train.step.engine", "forja.train.resilience.recovery"),
    ("forja.train.ft.replicas", "forja.train.launch.run_dir"),
    ("forja.train.launch.preflight", "forja.train.trainer"),
    ("forja.train.callbacks", "forja.train.cli"),
    ("forja.train.launch.data", "forja.train"),
    # inside data/: the corpus side never imports the loader; config neither side
    ("forja.data.corpus.prepare", "forja.data.load.loader"),
    ("forja.data.corpus.shards", "forja.data.load"),
    ("forja.data.config", "forja.data.corpus.tokenizer"),
    ("forja.data.corpus.cli", "forja.data"),
])
def test_the_checker_refuses_an_upward_import(importer, imported):
    assert not allowed(importer, imported)


@pytest.mark.parametrize(("importer", "imported"), [
    ("forja.train.trainer", "forja.train.step.engine"),
    ("forja.train.cli", "forja.train.launch.preflight"),
    ("forja.train.evaluation", "forja.train.callbacks"),
    ("forja.train.resilience.recovery", "forja.train.step.engine"),
    ("forja.data.load.loader", "forja.data.corpus.shards"),
    ("forja.data", "forja.data.load.loader"),
])
def test_the_checker_lets_a_floor_import_its_own_and_those_below(importer, imported):
    assert allowed(importer, imported)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    bad = tmp_path / "model.py"
    bad.write_text("import torch\n\ndef f():\n    from forja.parallel.fsdp import apply_fsdp\n")
    assert imports(bad) == {"forja.parallel.fsdp"}


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
