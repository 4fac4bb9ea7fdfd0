"""`python -m forja.train.ft.lighthouse`: a torchft lighthouse, the coordinator of a run's replica
groups (it forms each step's quorum from the groups' heartbeats and requests).

`forja train --ft-groups G` starts one itself (and starts it again, on the same port, if it dies);
on a cluster run it on one host and give each group's job its address (scripts/ft_groups.sbatch).
It prints its address on its first line of output and serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m forja.train.ft.lighthouse", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=29510, help="port to serve on (0: any free one)")
    p.add_argument("--min-groups", type=int, default=1, help="groups a quorum needs (ft.min_groups)")
    p.add_argument("--join-timeout-s", type=float, default=5.0,
                   help="how long a quorum waits for every known group (ft.join_timeout_s)")
    p.add_argument("--heartbeat-timeout-s", type=float, default=3.0,
                   help="a group silent this long is left out (ft.heartbeat_timeout_s)")
    args = p.parse_args(argv)
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{args.port}", min_replicas=args.min_groups,
                              join_timeout_ms=int(args.join_timeout_s * 1000), quorum_tick_ms=20,
                              heartbeat_timeout_ms=int(args.heartbeat_timeout_s * 1000))
    print(server.address(), flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
