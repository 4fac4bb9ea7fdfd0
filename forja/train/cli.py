"""`forja train`: train from a recipe, resuming the run directory's latest checkpoint.

With `--nproc` or `--nnodes` the command runs itself under torchrun's elastic agent, as
`python -m torch.distributed.run ... -m forja train ...` would (`torchrun_command`), the agent
in this process and the workers forked from a server that imported forja
(forja/train/launch/agent.py): on one machine with `--standalone`, on several with
torchrun's c10d rendezvous, where every machine runs the same command and they meet at
`--rdzv-endpoint` (see docs/parallelism.md, "Launching").
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys

from forja.errors import INTERRUPTED, ForjaError
from forja.train.launch.agent import enter_worker, launch, start_server
from forja.train.rehearse.cli import add_train_args, train_rehearsal


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model (resumes the run directory's latest checkpoint)",
                       description="Train a model. Rerunning the same command resumes the run.")
    p.add_argument("config", nargs="?", default="default",
                   help="a recipe name (configs/NAME.toml), a .toml path, or a run's config.toml "
                        "(default: 'default', the tiny Llama on the embedded stdlib corpus)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=100 (repeatable)")
    p.add_argument("--start-over", action="store_true",
                   help="delete what run.dir holds and begin afresh instead of refusing a different config")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes on this machine (one per GPU), launched through torchrun")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart every process up to K times when one dies (torchrun's elastic agent); "
                        "each restart resumes from the latest checkpoint")
    p.add_argument("--nnodes", type=int, default=1,
                   help="machines taking part; run the same command on each of them (needs --rdzv-endpoint)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="where the machines meet (torchrun's c10d rendezvous): a host every machine can "
                        "reach, usually the first one, and a free port on it")
    p.add_argument("--rdzv-id", default=None, metavar="ID",
                   help="the job's name at the rendezvous, the same on every machine "
                        "(default: derived from run.dir; under SLURM, $SLURM_JOB_ID)")
    p.add_argument("--ft-groups", type=int, default=None, metavar="G",
                   help="fault-tolerant replica groups (torchft, [ft]): start a lighthouse and G groups of --nproc "
                        "ranks here, each its own torchrun job; a group that dies is restarted alone "
                        "(--max-restarts) and heals from a live one")
    p.add_argument("--ft-group", type=int, default=None, metavar="g",
                   help="start only replica group g of --ft-groups G here (one job per group on a cluster: "
                        "scripts/ft_groups.sbatch); needs --ft-lighthouse HOST:PORT")
    p.add_argument("--ft-lighthouse", default=None, metavar="HOST:PORT",
                   help="the torchft lighthouse the groups meet at (default: --ft-groups starts one here)")
    add_train_args(p)  # --rehearse --world N: forja/train/rehearse/cli.py
    p.set_defaults(func=run)


def launch_needed(args: argparse.Namespace) -> bool:
    """Whether this process should start torchrun rather than train: it was asked for
    several processes or machines, and it is not already a torchrun worker."""
    return "LOCAL_RANK" not in os.environ and (
        (args.nproc or 1) > 1 or args.nnodes > 1 or args.rdzv_endpoint is not None or args.max_restarts > 0)


def torchrun_command(args: argparse.Namespace, run_dir: str) -> list[str]:
    """The torchrun command line that runs this same `forja train` in every process."""
    if args.nproc is not None and args.nproc < 1:
        raise ForjaError(f"--nproc {args.nproc}: give at least 1 process per machine")
    if args.nnodes < 1:
        raise ForjaError(f"--nnodes {args.nnodes}: give at least 1 machine")
    if args.max_restarts < 0:
        raise ForjaError(f"--max-restarts {args.max_restarts}: give 0 (no restarts) or more")
    if args.nnodes > 1 and args.rdzv_endpoint is None:
        raise ForjaError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, an address every machine "
                         "can reach (usually the first machine's hostname) and a free port on it")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc or 1}"]
    cmd += [f"--max-restarts={args.max_restarts}"] if args.max_restarts else []
    if args.rdzv_endpoint is None:
        cmd.append("--standalone")  # one machine: torchrun picks a free port itself
    else:
        # Every machine runs the same command, so the default id must come from what they
        # share: the run directory. Two runs meeting at one endpoint then stay apart.
        rdzv_id = args.rdzv_id or "forja-" + hashlib.sha1(run_dir.encode()).hexdigest()[:12]
        cmd += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}"]
    cmd += ["-m", "forja", "train", args.config]
    cmd += [a for o in args.overrides for a in ("--set", o)]
    cmd += ["--start-over"] if args.start_over else []
    return cmd


def launcher_preflight(cfg, *, nproc: int, nnodes: int) -> None:
    """The workers' preflight, run once here before torchrun starts: a bad launch stops with
    one sentence (exit code 2), not once per rank inside torchrun's traceback, and leaves no
    run directory or restart behind. The workers run it again (it writes nothing) and also
    check the GPU's memory where nvidia-smi could not tell it here."""
    from forja.parallel.process_group import device_type
    from forja.train.launch.preflight import Preflight

    Preflight(cfg, world_size=nproc * nnodes, device_type=device_type(cfg.train.device), ranks_here=nproc,
              in_worker=False).run()


def run(args: argparse.Namespace) -> int:
    if args.rehearse is not None:
        return train_rehearsal(args)
    overrides = list(args.overrides) + (["run.start_over=true"] if args.start_over else [])
    if args.ft_groups is not None or args.ft_group is not None:
        return _launch_ft(args, overrides)
    # The workers' server imports torch and forja on another core while this process does too.
    server_env = start_server(args.nproc or 1) if launch_needed(args) else None
    from forja.config import load_config

    cfg = load_config(args.config, overrides)  # errors surface before any process starts
    if server_env is not None:
        cmd = torchrun_command(args, str(cfg.run.dir))
        from forja.train.launch.finished import finished

        if finished(cfg):  # complete already: say so here rather than start torchrun to say it
            return 0
        launcher_preflight(cfg, nproc=args.nproc or 1, nnodes=args.nnodes)
        code = launch(cmd, worker, (cfg, list(sys.argv)), server_env=server_env, restarts=args.max_restarts > 0)
        if code > 128:
            print(stopped_line(cfg, signal.Signals(code - 128)), file=sys.stderr, flush=True)
        return code
    stopped_by = train(cfg)  # Ctrl-C in the loop: the step ends, a checkpoint is saved, one line says so
    return INTERRUPTED if stopped_by == "SIGINT" else 0


def stopped_line(cfg, sig: signal.Signals) -> str:
    """The one line a launch stopped by `sig` ends with: what stopped, what the run kept (its
    latest complete checkpoint, which the workers saved on their way out), how to go on."""
    from forja.checkpoint.verify import complete_checkpoints
    from forja.train.launch.stage_history import checkpoints_of

    what = "Ctrl-C (SIGINT)" if sig == signal.SIGINT else sig.name
    found = complete_checkpoints(checkpoints_of(cfg))
    if not found:
        return (f"forja train: stopped by {what} before a checkpoint was saved; rerun the same command to "
                "start the run")
    step, path = found[-1]
    return (f"forja train: stopped by {what}; every process stopped, the run keeps step {step} ({path}); "
            "rerun the same command to resume")


def train(cfg) -> str | None:
    """Train `cfg` in this process; return what stopped it early (a signal's name), if anything."""
    from forja.train.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.run()
    return trainer.stop_reason


# A worker stopped by a signal (the agent passes the launcher's on) exits with this code
# itself: an agent that is stopping the launch reads no worker's return value, and a worker
# that returned one would wait for it to be read until the agent's shutdown timeout killed it.
EXIT_STOPPED = 128 + signal.SIGTERM


def worker(cfg, launcher_argv: list[str], changes) -> None:
    """One process of a `--nproc` launch (forja/train/launch/agent.py): `forja train` with the
    launcher's checked config, under torchrun's environment."""
    enter_worker(launcher_argv, changes)
    try:
        stopped_by = train(cfg)
    except ForjaError as exc:
        print(f"forja train: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # the agent passed a Ctrl-C on before the loop's handler was set
        stopped_by = "SIGINT"
    if stopped_by is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STOPPED)


def _launch_ft(args: argparse.Namespace, overrides: list[str]) -> int:
    """Replica groups (forja/train/launch/ft_groups.py), after the same checks as any launch."""
    from forja.config import load_config
    from forja.train.launch.ft_groups import ft_overrides, launch_groups

    if "LOCAL_RANK" in os.environ:
        raise ForjaError("--ft-groups starts torchrun itself: run it directly, not under torchrun")
    if args.ft_groups is None or args.ft_groups < 1:
        raise ForjaError(f"--ft-groups {args.ft_groups}: give the number of replica groups, 1 or more"
                         + (" (with --ft-group g, the run's total)" if args.ft_group is not None else ""))
    if args.ft_group is not None and not args.ft_lighthouse:
        raise ForjaError("--ft-group starts one group of several jobs, which must meet at one lighthouse: "
                         "give --ft-lighthouse HOST:PORT (python -m forja.train.ft.lighthouse starts one)")
    cfg = load_config(args.config, ft_overrides(argparse.Namespace(overrides=overrides), args.ft_groups))
    return launch_groups(args, cfg, launcher_preflight=launcher_preflight, torchrun_command=torchrun_command)
