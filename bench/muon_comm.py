"""Distributed Muon's traffic, old vs new: collectives per step and bytes each rank receives.

Old: forja's Muon before the owner rebuild (git e930285, forja/optim/muon.py): every matrix
all-gathered to every rank, then broadcast from the rank that orthogonalized it, one
blocking collective each. New: forja/optim/muon.py + exchange.py: each matrix gathered to
its owner only, bucketed all_to_alls there and back.

Both are counted the same way, by a TorchDispatchMode that sees every c10d op a step runs
(collectives, and the bytes received: an all-gather's output minus its input, a broadcast's
tensor on the ranks it reaches, an all_to_all's output minus what a rank keeps; FSDP over
every rank, so group ranks are global ranks). The step counted is the second (the first also
exchanges each rank's block layout, once).

    .venv/bin/python bench/muon_comm.py --world 2 4 [--layers 4]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
OLD_REVISION = "e930285"


class CommCounter(TorchDispatchMode):
    """Counts the c10d ops run under it and the bytes they bring this rank."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank, self.collectives, self.received = rank, 0, 0
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if "c10d" not in name or "wait" in name or "wrap" in name:  # waits and autograd wrappers move nothing
            return out
        self.collectives += 1
        self.names[name] = self.names.get(name, 0) + 1
        if "all_gather_into_tensor" in name:
            self.received += (out.numel() - args[0].numel()) * out.element_size()
        elif "broadcast" in name:  # (tensors, process group, root rank, root tensor, ...)
            if self.rank != args[2]:  # the root's rank in the group: here the world group
                self.received += sum(t.numel() * t.element_size() for t in args[0])
        elif "alltoall_base" in name:  # (output, input, group, output splits, input splits, ...)
            output, splits = args[0], args[3]
            kept = splits[self.rank]  # flat (N,) buffers; the group is the world here
            self.received += (output.numel() - kept) * output.element_size()
        return out


def old_muon_class():
    source = subprocess.run(["git", "show", f"{OLD_REVISION}:forja/optim/muon.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("forja_old_muon")
    sys.modules["forja_old_muon"] = module
    exec(compile(source, "forja_old_muon.py", "exec"), module.__dict__)
    from forja.optim import muon

    module.newton_schulz = muon.newton_schulz  # the same function, counted in muon.NS_COUNT
    return module.Muon


def _worker(rank: int, world: int, layers: int, which: str):
    from torch.distributed.tensor import DTensor, distribute_tensor

    from forja.models import model_args
    from forja.optim import exchange, muon
    from forja.optim.config import OptimConfig
    from forja.optim.params import muon_param_groups
    from forja.parallel import ParallelConfig, ParallelDims
    from forja.train.build import build_model_parts

    cfg = ParallelConfig(dp_shard=world)
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    model = build_model_parts(model_args("llama", "debug", n_layers=layers), dims, cfg,
                              device=torch.device("cpu"), seed=0).parts[0]
    groups = muon_param_groups(model, OptimConfig(name="muon"))
    opt = (old_muon_class() if which == "old" else muon.Muon)(groups, lr=0.02)
    gen = torch.Generator().manual_seed(1)
    counter = CommCounter(rank)
    for step in range(2):
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) \
                if isinstance(p, DTensor) else g
        muon.NS_COUNT.clear()
        exchange.COMM.reset()
        if step == 1:
            with counter:
                opt.step()
        else:
            opt.step()
    whole = sum(p.numel() * 4 for g in groups if g["use_muon"] for p in g["params"])
    return dict(names=counter.names, collectives=counter.collectives, received=counter.received, whole=whole,
                wrapper=(exchange.COMM.collectives, exchange.COMM.bytes_received),
                ns=muon.NS_COUNT["matrices"], matrices=sum(len(g["params"]) for g in groups if g["use_muon"]))


def main() -> None:
    from forja.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(f"debug Llama, {args.layers} layers, FSDP over N ranks, fp32; the second Muon step")
    print("| ranks | Muon | matrices (MiB) | collectives / step | MiB received per rank | NS matrices per rank |")
    print("| --- | --- | --- | --- | --- | --- |")
    for world in args.world:
        for which in ("old", "new"):
            res = run_distributed(_worker, world, args.layers, which, timeout_s=300)
            mib = [r["received"] / 2**20 for r in res]
            r0 = res[0]
            print(f"| {world} | {which} | {r0['matrices']} ({r0['whole'] / 2**20:.2f}) | "
                  f"{max(r['collectives'] for r in res)} | {min(mib):.3f} - {max(mib):.3f} | "
                  f"{', '.join(str(r['ns']) for r in res)} |")
            print(f"<!-- {which}: {res[0]['names']} -->")
            if which == "new":
                print(f"<!-- forja's wrapper: {[r['wrapper'] for r in res]} -->")


if __name__ == "__main__":
    main()
