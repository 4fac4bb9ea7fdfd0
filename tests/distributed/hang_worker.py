"""A torchrun worker for tests/distributed/test_timeouts.py: trains as `forja train` does,
except that rank 1 stops answering after step 1, as a rank stuck in I/O, in a driver or on
a failing GPU would. The other ranks must then fail within parallel.timeout_s.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m tests.distributed.hang_worker --set KEY=VALUE ...
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from forja.config import load_config
from forja.errors import ForjaError
from forja.train.callbacks import Callback
from forja.train.trainer import Trainer


class HangAfterFirstStep(Callback):
    def on_train_start(self, trainer) -> None:
        if trainer.rank == 1:
            # A process hung in C code runs no Python signal handler (forja's preemption
            # handler included); the default action lets torchrun stop it, as it would be.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def on_step_end(self, trainer, record) -> None:
        if trainer.rank == 1 and record.step == 1:
            print(f"hang_worker: rank 1 (pid {os.getpid()}) stops answering after step 1", flush=True)
            time.sleep(3600)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    cfg = load_config("debug", parser.parse_args().overrides)
    try:
        Trainer(cfg, callbacks=[HangAfterFirstStep()]).run()
    except ForjaError as exc:  # printed as `forja train` prints it
        print(f"forja train: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
