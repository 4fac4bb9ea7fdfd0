"""The training loop. It reads like the algorithm:

    for each step: take a global batch -> the engine's train_step (forward/backward with
    accumulation, clip, optimizer and schedule step) -> recovery's verdict on it (go on,
    skipped, rolled back: forja/train/resilience/recovery.py); validate and checkpoint at their
    intervals.

Setup follows one order on every layout: process group and mesh, run directory, data,
model (forja/train/build.py's build order), optimizer and schedule, the step engine,
loaders, then resume from the run's latest complete checkpoint. How a step runs (plain or
pipelined, losses, contexts, groups) is the engine's business (engine.py); logging,
sampling, GC, profiling and preemption are callbacks (callbacks.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from forja import fallbacks, host
from forja.checkpoint.identity import check_model_identity, initial_weights, model_identity
from forja.checkpoint.manager import CheckpointManager, loadable_state
from forja.checkpoint.states import ModelState, OptimizerState, RNGState, TrainerCounters
from forja.config import Config
from forja.generate import SamplingConfig, generate
from forja.metrics.sinks import build_sinks
from forja.models import build_from_args
from forja.models.common.transformer import TransformerArgs
from forja.models.config import run_model_args
from forja.optim import OptimizerGroup, SchedulerGroup
from forja.parallel import ParallelDims
from forja.parallel.checks import check_layout
from forja.parallel.process_group import DistInfo, init_distributed, shutdown_distributed, timeout_error
from forja.train.build import ModelParts, build_model_parts
from forja.train.callbacks import Callback, StepRecord, default_callbacks
from forja.train.evaluation import EvalCallback
from forja.train.ft.checks import checkpoint_rounding
from forja.train.ft.config import checkpoint_due
from forja.train.ft.replicas import LeaderOnly, build_replicas, checkpoint_dir, group_dir, group_of
from forja.train.launch.agent import LAUNCHED_ENV
from forja.train.launch.data import data, decay_window, keep_tokenizer, loaders, stages
from forja.train.launch.finished import finished
from forja.train.launch.preflight import Preflight
from forja.train.launch.run_dir import RunDir, report_fallbacks
from forja.train.probes import ActivationSizes
from forja.train.resilience.drills import Drills, flipped, loss_factor
from forja.train.resilience.fingerprint import FingerprintCheck
from forja.train.resilience.goodput import Goodput, goodput_line
from forja.train.resilience.recovery import Outcome, Recovery
from forja.train.resilience.watchdog import Watchdog, grace_s
from forja.train.step.build import build_engine
from forja.train.step.engine import StepScales
from forja.train.step.scaler import loss_scaler


class Trainer:
    def __init__(self, cfg: Config, *, callbacks: Sequence[Callback] = ()):
        self.cfg = cfg
        self.extra_callbacks = list(callbacks)
        self.stop_reason: str | None = None
        self.finished_by_another: int | None = None  # [ft]: the step another group finished the run at
        self.fallbacks_pending = False  # a rank recorded a fallback the report has not seen (this step's agreement)
        self.counters = TrainerCounters()
        self.activation_sizes: dict[str, float] = {}  # of the last validation (forja/train/probes.py)

    # -- setup ------------------------------------------------------------------------------
    def setup(self) -> None:
        """The run's preflight, then the one build order; each step runs in this order on every
        layout and every rank, and the run resumes from its latest complete checkpoint last."""
        launched = time.time()
        info, evaluation = self._start_process()
        preflight, args = self._preflight_and_run_dir(info, launched)
        identity, built = self._build_model(args, info)
        self._build_step(built, identity, self.dataset)
        self._build_records(info, evaluation)
        self._resume()
        self.replicas.resume_at(self.counters.step)  # [ft]: a group behind the live ones heals here,
        self.replicas.join()  # before any record

    def _start_process(self) -> tuple[DistInfo, list[Callback]]:
        """This process's settings and process group: (the group's info, the [eval] callback or none)."""
        c = self.cfg
        fallbacks.clear()  # this run's decisions only, not those of an earlier run in this process
        host.prepare_training_process(c.train.host_malloc)  # malloc policy and intra-op threads, before any work
        evaluation = [EvalCallback(c)] if c.eval.tasks else []  # bad task files stop before any work
        # Collectives wait a grace longer than the watchdog, so that a hang is reported (every
        # rank's stack, the culprit named) before a timed-out collective ends the process.
        info = init_distributed(c.train.device, c.parallel.timeout_s + grace_s(c.parallel.timeout_s))
        self.rank, self.device = info.rank, info.device
        self.owns_process_group, self.attempt = info.owned, info.attempt  # the launcher counts restarts
        return info, evaluation

    def _preflight_and_run_dir(self, info: DistInfo, launched: float) -> tuple[Preflight, TransformerArgs]:
        """The preflight and the data, then the run directory and what keeps its records from the
        start: (the preflight, the model's args the tokenizer fixes)."""
        c = self.cfg
        # Every check that can fail the launch, before anything is written or computed.
        preflight = Preflight(c, world_size=info.world_size, device_type=self.device.type, rank=self.rank).run()
        c = self.cfg = preflight.cfg  # with parallel.auto's layout
        # A source is prepared (into the cache) and its splits checked before run.dir is written.
        self.tokenizer, self.dataset = data(c, rank=self.rank)
        args = run_model_args(c.model, self.tokenizer.vocab_size)
        if args != preflight.args:  # a tokenizer trained just now may hold fewer tokens than asked
            check_layout(preflight.request(args))
        self.group = group_of(c)  # the torchft replica group, or None
        self.directory = RunDir(c, rank=self.rank)  # run.dir in a store: self.run_dir is its local mirror
        self.run_dir: Path = self.directory.prepare(group=self.group)
        keep_tokenizer(self.tokenizer, self.run_dir, self.rank)
        own = self.own_dir = group_dir(self.run_dir, self.group)  # [ft]: G groups, G rank 0s, G folders
        preflight.write_plan(own)
        self.goodput = Goodput(own, rank=self.rank)
        self.goodput.start(launched)
        self.drills = Drills(c.debug.inject, rank=self.rank, run_dir=own, group=self.group)
        return preflight, args

    def _build_model(self, args: TransformerArgs, info: DistInfo) -> tuple[dict, ModelParts]:
        """The mesh, then the model in the one build order (forja/train/build.py): (identity, built)."""
        c = self.cfg
        self.dims = ParallelDims.from_config(c.parallel, info.world_size)
        self.dims.build_mesh(self.device.type)
        identity = model_identity(c.model.family, c.model.flavor, args)
        self.flops_per_token = build_from_args(args, device="meta").flops_per_token(c.train.seq_len)
        built = build_model_parts(args, self.dims, c.parallel, device=self.device, seed=c.train.seed,
                                  load_weights=initial_weights(c.model.init_from, identity), seq_len=c.train.seq_len,
                                  float8=c.train.float8, float8_min_features=c.train.float8_min_features)
        self.parts = built.parts
        report_fallbacks(self.own_dir, rank=self.rank, group=self.dims.cpu_group)  # one line each, and run.json
        return identity, built

    def _build_step(self, built: ModelParts, identity: dict, dataset: Any) -> None:
        """What a step runs with: optimizer and schedule, [ft] replicas, the engine, loaders, checkpoints."""
        c = self.cfg
        self.optimizers = OptimizerGroup(self.parts, c.optim)
        self.scheduler = SchedulerGroup(self.optimizers.optimizers, c.schedule, c.train.steps, decay=decay_window(c))
        folder = checkpoint_dir(self.directory.checkpoints, c, self.group)
        self.replicas = build_replicas(c, group=self.group, state=self._shared_state, model=identity,  # [ft]
                                       parts=self.parts, device=self.device, checkpoints=folder,
                                       cpu_group=self.dims.cpu_group, attempt=self.attempt)
        self.engine = build_engine(self.parts, built.pipeline, self.optimizers, self.scheduler, self.dims,
                                   device=self.device, precision=c.train.precision, grad_clip=c.train.grad_clip,
                                   document_mask=c.model.document_mask, scaler=loss_scaler(c.train),
                                   replicas=self.replicas, grad_sync=c.parallel.grad_sync)
        self.loader, self.val_loader = loaders(c, dataset, dp_rank=self.dims.dp_rank, dp_size=self.dims.dp,
                                               later=stages(c, self.tokenizer, rank=self.rank))
        self.checkpoints = CheckpointManager(c.checkpoint, folder, rank=self.rank, meta=identity, device=self.device)

    def _build_records(self, info: DistInfo, evaluation: list[Callback]) -> None:
        """What watches and records the steps: sinks, callbacks, the watchdog, recovery, fingerprints."""
        c = self.cfg
        self.sinks = build_sinks(c.metrics, run_dir=self.run_dir, run_name=c.run.name or self.run_dir.name,
                                 config=c.to_dict(), rank=self.rank)
        self.callbacks = default_callbacks(c, flops_per_token=self.flops_per_token, num_devices=self.dims.world_size,
                                           device=self.device, compute_dtype=self.engine.compute_dtype)
        self.callbacks += evaluation + self.extra_callbacks
        self.watchdog = Watchdog(self.own_dir, rank=self.rank, world_size=info.world_size,
                                 timeout_s=c.parallel.timeout_s, attempt=self.attempt)
        self.recovery = Recovery(c.train, checkpoints=self.checkpoints, counters=self.counters, loader=self.loader,
                                 sinks=LeaderOnly(self.sinks, self._leads),  # [ft]: one record per event
                                 reload=self._reload, beat=self.watchdog.beat,
                                 rolled_back=lambda: self.goodput.beat(rollback=True), rank=self.rank)
        self.fingerprints = self._fingerprints()

    @property
    def model(self):
        """The whole model, when this rank holds it (no pipeline parallelism); else None."""
        return self.engine.model

    def checkpoint_state(self) -> dict:
        state = {"model": ModelState(self.parts), "optim": OptimizerState(self.parts, self.optimizers.optimizers),
                 "scheduler": self.scheduler, "dataloader": self.loader, "trainer": self.counters,
                 "health": self.recovery.detector, f"rng.rank{self.rank}": RNGState()}
        state |= self.engine.stateful()  # fp16: the loss scale the run has found ("scaler")
        if getattr(self, "replicas", None) is not None and self.replicas.outer is not None:  # built yet?
            state["outer"] = self.replicas.outer  # diloco: the global weights and outer momenta
        return state

    def _shared_state(self) -> dict:
        """What a live replica group sends one that rejoins: the checkpoint's pieces but this rank's RNG."""
        return {k: v for k, v in self.checkpoint_state().items() if not k.startswith("rng.")}

    def _resume(self) -> None:
        # [ft] hsdp: the groups share one checkpoint folder, which its launcher tidies before any group
        # starts (ft_groups.py); a group restarted alone must not delete or move what the leader writes.
        tidy = not self.replicas.shares_checkpoints
        if self.cfg.checkpoint.enabled:
            self.checkpoints.check_writable()
            if tidy:
                self.checkpoints.clean_partial()
        latest = self.checkpoints.resume_point(tidy=tidy)  # the newest intact one; damaged newer ones are named
        if latest is None:
            return
        self._load(latest)
        if self.rank == 0:
            print(f"forja: resumed from {latest} (step {self.counters.step})", flush=True)

    def _load(self, path: Path) -> None:
        # A checkpoint saved before forja watched for spikes has no "health"; one saved in another
        # precision no "scaler" (the scale then starts from train.fp16_init_scale).
        # One saved before the loader recorded its tokens has its position alone (the tokens follow).
        state = loadable_state(self.checkpoint_state(), path, optional=("health", "scaler"),
                               partial=("dataloader",))
        self.checkpoints.load(path, state, check=self.checkpoints_match)
        self.scheduler.reapply()  # train.steps may have changed, and with it the schedule

    def _reload(self, path: Path) -> None:
        """A rollback's reload: under [ft] every group goes back to the same step, and says so."""
        self._load(path)
        self.replicas.resume_at(self.counters.step)

    def _fingerprints(self) -> FingerprintCheck:
        """Silent data corruption: who compares weights with whom (forja/train/resilience/fingerprint.py)."""
        return FingerprintCheck(self.cfg.ft.check_interval,
                                replicate_group=self.dims.mesh["dp_replicate"].get_group()
                                if self.dims.dp_replicate > 1 else None,
                                across_groups=self.replicas.fingerprint_peers())

    def _checkpoint_due(self, step: int) -> bool:
        """Whether `step` takes an interval's checkpoint (under DiLoCo, at the sync that follows it)."""
        k = self.cfg.checkpoint
        return k.enabled and checkpoint_due(step, k.interval, self.cfg.ft.sync_period)

    def _saves_at(self, step: int) -> bool:
        return self._checkpoint_due(step) or (self.cfg.checkpoint.enabled and step == self.cfg.train.steps)

    def checkpoints_match(self, meta: dict) -> None:
        check_model_identity(meta, self.checkpoints.meta)

    # -- the loop ---------------------------------------------------------------------------
    def begin(self) -> None:
        """What comes before the first step: the sinks, the callbacks' start, the watchdog. A
        caller stepping with train_one_step itself (bench/peers_forja.py) calls it once too."""
        self.sinks.start(total_steps=self.cfg.train.steps, start_step=self.counters.step,
                         purge=self.replicas.purges_records)
        self._call("on_train_start")
        if self.rank == 0 and self._leads() and (line := checkpoint_rounding(self.cfg)):
            print(f"forja: {line}", flush=True)
        self.watchdog.start()

    def fit(self) -> None:
        cfg = self.cfg
        if self._finished_by_another():  # [ft]: restarted after the leader's last save
            self._stand_down()  # before the sinks start: it records nothing
            return
        self.begin()
        self.goodput.ready()
        last_saved = self.counters.step if self.checkpoints.latest() else -1
        while (before := self.counters.step) < cfg.train.steps and self.train_one_step():
            step = self.counters.step
            self.checkpoints.poll()  # an async save every rank finished becomes the latest checkpoint
            if step == before or self.recovery.is_replay(step):  # [ft]: not committed, trained again;
                continue  # replayed: validated and saved the first time round
            if cfg.train.val_interval and self._leads() and (step % cfg.train.val_interval == 0
                                                               or step == cfg.train.steps):
                self.validate()  # [ft]: by the first live group alone
            if self._checkpoint_due(step) and self.replicas.saves_checkpoints:
                self.save_checkpoint()
                last_saved = step
        if self.finished_by_another is not None:
            self._stand_down()
            return
        if self.counters.step != last_saved and self.replicas.saves_checkpoints:
            self.save_checkpoint()
        self.checkpoints.wait()
        self.watchdog.stop()
        self.replicas.write_summary(self.own_dir, self.parts, self.counters.step)  # [ft]: steps, heals, digest
        self._finish()
        self.directory.sync()  # a store's run.dir: its files as they end (metrics.jsonl is flushed per line)

    def train_one_step(self) -> bool:
        """One optimizer step (or a rollback); False when the ranks agreed to stop before it."""
        share = self.replicas.begin_step()  # [ft]: the quorum, which may heal this group
        step = self.counters.step + 1
        self.watchdog.beat("step", step)
        start = time.perf_counter()
        fault = self.drills.before_step(step)
        self.drills.act_on_state(fault, self.parts, self.checkpoints)  # a bitflip or slowsave drill
        waited = self.loader.data_wait_s
        batches = self.loader.next_step(share.index, share.count)
        data_wait = self.loader.data_wait_s - waited
        agreed = time.perf_counter()
        if self._should_stop() or self._finished_by_another():
            self.loader.rewind_step()  # not taken: a resume must train on it
            return False
        sync_wait = time.perf_counter() - agreed  # waiting for slower ranks (forja/train/resilience/stragglers.py)
        scales = StepScales(fault=loss_factor(fault), lr=self.recovery.lr_scale(step), flip=flipped(fault))
        rerun = bool(every := self.cfg.ft.rerun_interval) and step % every == 0  # corruption a gradient carries
        out = self.engine.train_step(batches, guard=self.recovery.guard(), scales=scales, rerun=rerun,
                                     replica_share=share)
        if not out.committed:  # a replica group failed mid-step: trained again by the groups left
            self.loader.rewind_step()
            return True
        # Skip, roll back or stop on an anomaly (forja/train/resilience/recovery.py).
        if self.recovery.step(step, out) is Outcome.ROLLED_BACK:
            return True  # the counters are the checkpoint's now
        self.counters.step = step
        self.counters.tokens_seen += out.tokens
        self.replicas.end_step(step)  # diloco: a fragment's sync starts or lands (a restarted group heals)
        if self.fingerprints.due(step, saves=self._saves_at(step)) and not self.recovery.is_replay(step):
            mismatch = self.fingerprints.compare(self.parts)  # replicas whose weights should be equal
            if mismatch is not None and self.recovery.corrupted(step, mismatch) is Outcome.ROLLED_BACK:
                return True
        step_time = time.perf_counter() - start
        if not out.skipped:
            self.counters.productive_s += step_time
        record = StepRecord(step=step, loss=out.loss, grad_norm=out.grad_norm, lr=out.lr, tokens=out.tokens,
                            step_time=step_time, data_wait=data_wait, sync_wait=sync_wait, skipped=out.skipped,
                            replay=self.recovery.is_replay(step),
                            extra={"seq_len": batches[0].input_ids.shape[1], **self.loader.step_metrics(batches),
                                   **out.metrics, **({"ft/groups": share.count} if share else {})})
        if self._leads():  # a schedule's length, the data stage, tokens per source: one record per step
            self._call("on_step_end", record)
        return True

    @torch.no_grad()
    def validate(self) -> float | None:
        if self.val_loader is None:
            return None
        self.watchdog.beat("validation", self.counters.step)
        total, count = torch.zeros((), device=self.device), 0
        with self._eval_mode(), ActivationSizes(self.parts) as sizes:
            for batch in self.val_loader:
                total += self.engine.eval_loss(batch)
                count += 1
        self.activation_sizes = sizes.means()
        stats = torch.stack([total, torch.tensor(float(count), device=self.device)])
        if dist.get_world_size() > 1:
            dist.all_reduce(stats, group=self.dims.loss_group)
        val_loss = (stats[0] / stats[1]).item()
        self._call("on_validation_end", self.counters.step, val_loss)
        return val_loss

    def save_checkpoint(self) -> None:
        if not self.cfg.checkpoint.enabled:
            return
        self.watchdog.beat("checkpoint", self.counters.step)
        started = time.perf_counter()
        path = self.checkpoints.save(self.counters.step, self.checkpoint_state(),
                                     {"tokens_seen": self.counters.tokens_seen})
        self.goodput.beat(checkpoint_s=time.perf_counter() - started)  # the loop stood still this long
        self.directory.sync()  # a store's run.dir: metrics, goodput and run.json as of this checkpoint
        self.recovery.checkpointed(self.counters.step)
        self._call("on_checkpoint", self.counters.step, path)

    def _finish(self) -> None:
        """Goodput over every launch of the run, then the end-of-training callbacks."""
        self.goodput.end()
        figures = self.goodput.summary(self.counters.productive_s)
        if self._leads():
            self.log(self.counters.step, figures)
        if self.rank == 0:
            print(goodput_line(figures), flush=True)
        if self.stop_reason is None:
            self._call("on_train_end")
        elif self.rank == 0 and LAUNCHED_ENV not in os.environ:  # else the launcher says it
            print(f"forja: stopped by {self.stop_reason} at step {self.counters.step}; checkpoint saved, "
                  "rerun the same command to resume", flush=True)

    def sample(self, prompt: str, max_new_tokens: int) -> str | None:
        """Greedy continuation of `prompt`; None under pipeline or tensor parallelism (no rank
        holds whole layers: export the checkpoint and use `forja generate`)."""
        if self.model is None or self.dims.tp > 1:
            return None
        # After the end-of-document token, as every document follows one in the packed data.
        ids = [self.tokenizer.eos_id] + self.tokenizer.encode(prompt)
        tokens = torch.tensor([ids], device=self.device)
        max_new_tokens = min(max_new_tokens, self.model.args.max_seq_len - len(ids))
        with self.engine.autocast():
            out = generate(self.model, tokens, SamplingConfig(max_new_tokens=max_new_tokens,
                                                              stop_token=self.tokenizer.eos_id))
        new = [t for t in out[0, len(ids):].tolist() if t != self.tokenizer.eos_id]
        return prompt + self.tokenizer.decode(new)

    # -- logging, through the run's metric sinks ---------------------------------------------
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.sinks.log(step, metrics)
        self.directory.sync_often()  # a store's run.dir: metrics.jsonl uploaded every few seconds

    def log_text(self, step: int, name: str, text: str) -> None:
        self.sinks.log_text(step, name, text)

    # -- stopping ---------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def _leads(self) -> bool:
        """Whether this process's group records and validates the step (the first live replica
        group under [ft]; always without)."""
        return self.replicas.leads

    def _should_stop(self) -> bool:
        """Whether any rank was asked to stop; all ranks agree, so they stop at the same step. The
        same agreement says whether any rank recorded a new fallback (reported after this step)."""
        flags = torch.tensor([self.stop_reason is not None, fallbacks.pending()], dtype=torch.int32)
        if dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.dims.cpu_group)
        stop, self.fallbacks_pending = (bool(f) for f in flags.tolist())
        if stop and self.stop_reason is None:
            self.stop_reason = "another rank's signal"
        return stop

    def _finished_by_another(self) -> bool:
        """[ft]: whether another replica group has finished the run this one is behind on."""
        self.finished_by_another = self.replicas.finished_by_another(self.counters.step, self.cfg.train.steps)
        return self.finished_by_another is not None

    def _stand_down(self) -> None:
        """The end of a group that found the run finished by another: it writes no checkpoint and
        no record (the finishing group wrote them), only its own summary."""
        self.checkpoints.wait()
        self.watchdog.stop()
        self.goodput.end()
        self.replicas.write_summary(self.own_dir, self.parts, self.counters.step)
        if self.rank == 0:
            print(f"forja: replica group {self.group} stops at step {self.counters.step}: another group finished "
                  f"the run (its checkpoint of step {self.finished_by_another} is in the shared folder)", flush=True)

    def beat(self, phase: str, step: int) -> None:
        """Tell the hang watchdog that `phase` of `step` is under way (a long callback's work)."""
        self.watchdog.beat(phase, step)

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    def logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Forward-only logits of tokens (B, T) in eval mode (the step engine's `logits`: sharded
        over the vocabulary under TP, None on a pipeline rank without the last stage)."""
        with self._eval_mode():
            return self.engine.logits(tokens)

    @contextlib.contextmanager
    def _eval_mode(self):
        """The model parts in eval mode (no MoE load counting), back in train mode after."""
        for part in self.parts:
            part.eval()
        try:
            yield
        finally:
            for part in self.parts:
                part.train()

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """`values` of every rank, by rank (one small collective on the CPU group)."""
        if dist.get_world_size() == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.dims.cpu_group))]
        dist.all_gather(out, mine, group=self.dims.cpu_group)
        return [t.tolist() for t in out]

    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    # -- running ----------------------------------------------------------------------------
    def run(self) -> None:
        """setup + fit, always releasing the callbacks, sinks, loaders and process group. A
        collective that timed out (another rank hung or died) stops with a sentence naming
        parallel.timeout_s instead of a backend traceback."""
        if finished(self.cfg):  # train.steps reached: say so, append nothing (forja/train/launch/finished.py)
            return
        try:
            self.setup()
            self.fit()
        except RuntimeError as exc:
            error = timeout_error(exc, self.cfg.parallel.timeout_s)
            if error is None:
                raise
            raise error from exc
        finally:
            self.close()

    def close(self) -> None:
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.stop()
        for cb in getattr(self, "callbacks", []):
            cb.close()
        if getattr(self, "sinks", None) is not None:
            self.sinks.close()
        if getattr(self, "loader", None) is not None:
            self.loader.close()  # stops its prefetch thread
        if getattr(self, "directory", None) is not None:
            self.directory.final_sync()  # a failed run's files reach its store too, as far as they can
        if getattr(self, "replicas", None) is not None:
            self.replicas.close()
        if getattr(self, "owns_process_group", True):  # a host program's group outlives the run
            shutdown_distributed()
