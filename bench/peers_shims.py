"""What torchtitan 0.3.0 needs to run in bench/peers.py, each a short function returning the one
line the harness prints about it. Imported only inside the side environment (.peers-venv/),
where torchtitan is installed; torchtitan is imported inside the functions.

- On CPU, `cpu_device()` must run before any other torchtitan module is imported: torchtitan
  chooses its device once, at the import of torchtitan.tools.utils, and picks "cuda" when torch
  finds no accelerator; the modules that follow copy that choice by name.
- Everywhere, `token_rows()` and `vocab_only()` replace the two components its Trainer builds
  from files we do not have (a Hugging Face tokenizer in hf_assets_path, a Hugging Face dataset),
  through its own extension point (a Configurable's Config), so that torchtitan trains on the
  harness's token rows, the ones every contender gets, through its own StatefulDataLoader.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass

import torch
from peers_worker import cycle_positions, cycle_rows


def _cpu_module() -> types.ModuleType:
    """torch.cpu with the five calls torchtitan's DeviceMemoryMonitor makes of a device module
    (torch.cpu has none of them): no allocator statistics, the host's memory as capacity."""
    m = types.ModuleType("cpu_for_torchtitan")
    m.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("_")})
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    m.get_device_name = lambda device=None: "cpu"
    m.get_device_properties = lambda device=None: types.SimpleNamespace(name="cpu", total_memory=memory)
    m.memory_stats = lambda device=None: {}  # its monitor reads -1 for each missing statistic
    m.reset_peak_memory_stats = lambda device=None: None
    m.empty_cache = lambda: None
    return m


def cpu_device() -> str:
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", _cpu_module()
    return ("cpu_device: torchtitan.tools.utils.device_type 'cuda' -> 'cpu' (it falls back to cuda when torch "
            "finds no accelerator), its device_module torch.cpu plus get_device_name/get_device_properties/"
            "memory_stats/reset_peak_memory_stats/empty_cache for DeviceMemoryMonitor (no statistics)")


def token_rows():
    """(description, the dataloader Config class): torchtitan's ParallelAwareDataloader (its
    StatefulDataLoader) over the harness's token file, rows in bench/peers_worker.cycle_rows'
    order, each sample shaped as its text datasets yield them (input, positions; labels)."""
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader

    class TokenRows(IterableDataset):
        def __init__(self, path: str, documents: str, seq_len: int, batch: int):
            self.spec = {"tokens": path, "documents": documents, "per_document": bool(documents),
                         "seq_len": seq_len, "batch": batch}

        def __iter__(self):
            # Positions restarting at each document make its block-causal masks; else one document a row.
            positions = cycle_positions(self.spec)  # [B, T]
            for rows, places in zip(cycle_rows(self.spec, torch.device("cpu")), positions):  # [B, T + 1], [B, T]
                for row, place in zip(rows, places):
                    yield {"input": row[:-1], "positions": place}, row[1:]

    class TokenRowsLoader(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            dataset: str = "forja-peers-token-rows"
            documents_path: str = ""  # the rows' document ids (bench/peers.py): "" for one document a row

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                     local_batch_size: int, snapshot_every_n_steps: int | None = None, **kwargs):
            assert dp_world_size == 1, "the harness runs one process"
            rows = TokenRows(config.dataset_path, config.documents_path, seq_len, local_batch_size)
            super().__init__(rows, dp_rank=dp_rank,
                             dp_world_size=dp_world_size, batch_size=local_batch_size,
                             num_workers=config.num_workers, snapshot_every_n_steps=snapshot_every_n_steps)

    return ("token_rows: dataloader = a ParallelAwareDataloader over the harness's token file "
            "(its Hugging Face text dataset replaced)"), TokenRowsLoader.Config


def vocab_only():
    """(description, the tokenizer Config class): a tokenizer that only knows its vocabulary size;
    the rows are tokens already, so nothing is encoded."""
    from torchtitan.components.tokenizer import BaseTokenizer

    class VocabOnly(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config: Config, *, tokenizer_path: str | None = None):
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("the harness's rows are tokens already")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("the harness's rows are tokens already")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    return ("vocab_only: tokenizer = one that knows only the vocabulary size (its Hugging Face tokenizer "
            "from hf_assets_path replaced)"), VocabOnly.Config
