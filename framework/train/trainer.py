"""The training loop: a few small functions — setup, step, evaluate, log, save — around an `Engine`.

    trainer = Trainer(cfg); result = trainer.train()

Running the same config again resumes from the run directory's `latest` checkpoint; metrics.jsonl records
after the resumed step are dropped so the file always reads as one run.
"""

from __future__ import annotations

import json
import os
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from data_pipeline.read.loader import BatchLoader
from data_pipeline.read.prefetch import PrefetchingLoader
from framework.base.errors import ConfigError, DivergenceError
from framework.base.locks import DirLock
from framework.base.logs import get_logger, setup_logging
from framework.base.run_dir import RunDir
from framework.checkpoint.guard import Verdict
from framework.checkpoint.runtime import FaultTolerance
from framework.config import Config, dump_config, to_dict
from framework.engine import Engine, resolve_device
from framework.parallel.offload import offload_optimizers
from framework.train.documents import resolve_documents
from framework.train.local_engine import LocalEngine
from framework.train.lr_schedule import lr_at, section_lr_at
from framework.train.online_mixing import OnlineMixer
from framework.train.parallel_engine import build_parallel_engine
from framework.train.triage import Triage, triage
from models.documents import DocumentMasking

log = get_logger("train")


class MetricSink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """metrics.jsonl, always on (rank 0)."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir

    def log(self, record: dict[str, Any]) -> None:
        self.run_dir.append_metrics(record)

    def close(self) -> None:
        pass


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)
    """Train loss by step (this start only)."""
    tokens_per_s: float = 0.0
    mean_step_time_s: float = 0.0
    eval: dict[str, float] = field(default_factory=dict)
    exit_code: int = 0
    """checkpoint.requeue_exit_code after a SIGTERM/SIGUSR1 stop, 130 after SIGINT (the checkpoint has committed
    either way), else 0."""

    @property
    def first_loss(self) -> float:
        return self.losses[min(self.losses)] if self.losses else float("nan")

    @property
    def last_loss(self) -> float:
        return self.losses[max(self.losses)] if self.losses else float("nan")


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS is deterministic only with a fixed workspace (CUDA docs, "Results reproducibility"); it is read
        # when the first cuBLAS handle is made, so it must be set before any matmul. A value already set is kept.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def build_engine(cfg: Config, device: torch.device, documents: DocumentMasking | None = None) -> Engine:
    """The single-process engine for a 1-rank run without parallel settings; the parallel engine otherwise.

    `documents`: per-document attention / positions (data.document_mask), resolved against the data's EOD id.
    """
    _, world = _world()
    p = cfg.parallel
    if world == 1 and p.tp == p.pp == p.ep == p.dp_replicate == 1 and p.dp_shard in (-1, 1):
        local = LocalEngine(cfg.model, cfg.train, device, documents)
        local.optimizers = offload_optimizers(local.optimizers, p.nvme_offload, device)  # NVMe (PARALLELISM.md)
        return local
    return build_parallel_engine(cfg.model, cfg.train, cfg.parallel, device, documents=documents)


class Trainer:
    """Owns one run: its directory, data, engine, and the loop."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.rank, self.world = _world()
        self.run_dir = RunDir(cfg.run.path)
        if self.rank == 0:
            self.run_dir.create()
        setup_logging(self.rank, self.world, self.run_dir.log_file)
        self.device = resolve_device(cfg.run.device)
        seed_everything(cfg.train.seed, cfg.train.deterministic)
        # (from_step, at_sample, global batch size) per batch size trained with: places data.schedule's phases
        self.batch_history: list[tuple[int, int, int]] = [(0, 0, cfg.train.global_batch_size)]
        self.data = self._prepare_data()
        documents = resolve_documents(cfg.data, self.data.eos_id, cfg.model.vocab_size)  # data.document_mask
        self.engine = build_engine(cfg, self.device, documents)
        self.loader = self._make_loader()
        self.mixer = OnlineMixer(cfg.data, cfg.train, self.data, self.engine.dp_rank, self.engine.dp_size)
        from framework.observe.observer import Observer

        self.observer = Observer.for_config(cfg, self.run_dir.path, self.rank, self.world, self.device)
        self.observer.attach(self.engine.model_parts, self.engine.optimizers)
        self.sinks: list[MetricSink] = [JsonlSink(self.run_dir), *self.observer.sinks] if self.rank == 0 else []
        self.step = 0
        self.triaged: Triage | None = None  # the spike triage of the last skipped step
        self._memory_due = False  # write the engine's memory report during this step (`train`)
        self.ft = FaultTolerance(cfg.checkpoint, self.run_dir.path, self.device, section_lr_at)
        self.tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        from framework.infer.downstream import DownstreamEval

        self.downstream = DownstreamEval(cfg.eval, self.data, cfg.data.seq_len, cfg.data.val_fraction,
                                         cfg.model.vocab_size, self.run_dir.path, self.rank)

    # --- setup ---------------------------------------------------------------------------------------------
    def _prepare_data(self) -> Any:
        from data_pipeline.read.prepare import check_build_vocab, check_vocab, prepare_data

        check_build_vocab(self.cfg.data, self.cfg.model.vocab_size)  # before the mixture is drawn
        # One builder per node: node-local cache dirs work, and on a shared filesystem builders serialize on a lock.
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        data = prepare_data(self.cfg.data, is_builder=local_rank == 0,
                            global_batch_size=self.cfg.train.global_batch_size,
                            batch_history=self.batch_history)  # places data.schedule phases
        check_vocab(data.vocab_size, self.cfg.model.vocab_size)
        return data

    def _make_loader(self) -> Any:
        if getattr(self, "loader", None) is not None:
            self.loader.close()
        # The next batch is read (pinned, sent on a side stream on accelerators) while this step runs.
        return PrefetchingLoader(BatchLoader(self.data.train, global_batch_size=self.cfg.train.global_batch_size,
                                             micro_batch_size=self.cfg.train.micro_batch_size,
                                             dp_rank=self.engine.dp_rank, dp_size=self.engine.dp_size), self.device)

    def _follow_batch_history(self, path: Path) -> None:
        """Before loading `path`: take its batch-size history, plus this run's batch size when it is new.

        With `data.schedule`, a phase keeps the sample it started at under the old batch size and a later phase
        starts at its step under the new one (docs/CHECKPOINTS.md), so the data is prepared again when that moves.
        """
        from framework.checkpoint.dcp import read_meta

        meta = read_meta(path)
        saved_gbs = ((meta.get("config") or {}).get("train") or {}).get("global_batch_size")
        history = [(int(a), int(b), int(c)) for a, b, c in meta.get("batch_history") or []]
        history = history or ([(0, 0, int(saved_gbs))] if saved_gbs else [])
        gbs = self.cfg.train.global_batch_size
        if not history or history[-1][2] != gbs:
            history.append((int(meta.get("step", 0)), int((meta.get("loader") or {}).get("consumed_samples", 0)),
                            gbs))
        if history != self.batch_history:
            self.batch_history = history
            if self.cfg.data.schedule:
                self.data = self._prepare_data()
                self.loader = self._make_loader()

    def _data_build(self) -> str | None:
        """The fingerprint of the data build's manifest (None for synthetic data): resume rules compare it."""
        build_dir = getattr(self.data, "build_dir", None)
        manifest = Path(build_dir) / "manifest.json" if build_dir else None
        if manifest is None or not manifest.is_file():
            return None
        return str(json.loads(manifest.read_text()).get("fingerprint"))

    def _tokenizer_paths(self) -> dict[str, str | None]:
        """Absolute paths of the tokenizer and the data build, so that export and generate find the tokenizer from
        any directory without preparing the data (framework/checkpoint/run_tokenizer.py)."""
        tok, build_dir = self.data.tokenizer_path, getattr(self.data, "build_dir", None)
        return {"tokenizer": str(Path(tok).resolve()) if tok else None,
                "data_build_dir": str(Path(build_dir).resolve()) if build_dir else None}

    def resume(self) -> bool:
        """Load the newest valid checkpoint (and checkpoint.resume); truncate metrics after it. True if resumed."""
        if not self.cfg.checkpoint.resume:
            return False
        path = self.ft.manager.resume_point()
        if path is None:
            return False
        self._load(path)
        if self.rank == 0:
            dropped = self.run_dir.truncate_metrics_after(self.step)
            log.info("resumed from %s (step %d); dropped %d later metric records", path.name, self.step, dropped)
        return True

    def _load(self, path: Path) -> dict[str, Any]:
        self._follow_batch_history(path)
        meta = self.ft.manager.load(path, self.engine.model_parts, self.engine.optimizers, to_dict(self.cfg),
                                    self.data.fingerprint, data_build=self._data_build())
        self.step = int(meta["step"])
        self.loader.load_state_dict(meta["loader"])
        self.ft.guard.load_state_dict(meta.get("guard"))
        self.engine.load_extra_state(meta.get("engine"))  # the fp16 loss scale and its growth tracker
        self.mixer.load_state_dict(meta.get("mixing"), self.loader)  # data.mixing=online: the phases so far
        return meta

    def rollback(self) -> None:
        """After `guard.max_consecutive` skipped steps: reload the last checkpoint, skip the bad data window.

        Raises:
            DivergenceError: past checkpoint.guard.max_rollbacks, or at a second rollback to the same checkpoint.
        """
        bad_step, consumed = self.step, self.loader.consumed_samples
        path = self.ft.manager.resume_point()
        guard = self.ft.guard
        target = path.name if path else ""
        refusal = guard.rollback_refusal(target)
        if refusal is not None:
            self.log_record({"type": "guard_stop", "step": self.step, "rollbacks": guard.rollbacks,
                             "skipped_total": guard.skipped_total, "reason": refusal})
            raise DivergenceError(
                f"the loss guard skipped {guard.cfg.max_consecutive} steps in a row up to step {bad_step} again and "
                f"stops the run: {refusal}. Training diverges whatever data it skips: lower train.lr (now "
                f"{self.cfg.train.lr:g}) or raise train.warmup_steps, check the data, then resume (the checkpoints "
                f"are intact); metrics.jsonl has a guard_stop record")
        counters = guard.skipped_total, guard.rollbacks, dict(guard.rollback_targets)
        if path is not None:
            self._load(path)
        guard.skipped_total, guard.rollbacks, guard.rollback_targets = counters  # cumulative over the run
        guard.rolled_back(target)
        window = [self.loader.consumed_samples, consumed]
        if self.triaged is not None and self.triaged.quarantined:  # the quarantine skips just the spike's samples
            window[1] = window[0]
        self.loader.load_state_dict({"consumed_samples": window[1]})  # continue after the offending samples
        log.warning("guard: %d bad steps in a row up to step %d; rolled back to %s and skipped samples [%d, %d)",
                    self.cfg.checkpoint.guard.max_consecutive, bad_step, path.name if path else "nothing (no "
                    "checkpoint yet: weights kept)", *window)
        # The skipped steps' records stay in metrics.jsonl (the rollback record explains the repeated steps).
        self.log_record({"type": "rollback", "step": self.step, "from_step": bad_step, "skipped_samples": window,
                         "checkpoint": path.name if path else None})

    # --- the loop ------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns its train record."""
        t0 = time.perf_counter()
        batch = self.loader.next_batch()
        t_data = time.perf_counter()
        loss = self.engine.forward_backward(batch)
        t_fb = time.perf_counter()
        grad_norm = self.engine.clip_grad_norm(self.cfg.train.grad_clip)
        lr = lr_at(self.cfg.train, self.step)
        # An fp16 overflow is the loss scaler's skip (it backs off), not a guard verdict: it never counts to a rollback.
        overflow = self.engine.grads_overflowed()
        if self._memory_due:  # gradients and (after a first step or a resume) optimizer states are all held now
            self._memory_due = False
            self.log_record({"type": "memory", "step": self.step + 1, **self.engine.memory_report()})
        verdict = Verdict(False) if overflow else self.ft.guard.check(loss, grad_norm)
        grads = self.engine.layer_grad_norms(grad_norm) if verdict.skip and self.cfg.checkpoint.guard.triage else []
        applied = self.engine.optimizer_step(lr, apply=not verdict.skip)  # the engine ends every step
        t_end = time.perf_counter()
        self.step += 1
        dt = t_end - t0
        record = {
            "type": "train", "step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens": self.step * self.tokens_per_step, "tokens_per_s": self.tokens_per_step / dt,
            "step_time_s": dt, "data_time_s": t_data - t0, "fwd_bwd_time_s": t_fb - t_data,
            "optim_time_s": t_end - t_fb, "memory_mb": memory_mb(self.device), "skipped": not applied,
        }
        if overflow:
            record["overflow"] = True
        if verdict.skip:
            record.update(guard=verdict.reason, guard_zscore=verdict.zscore,
                          guard_skipped_total=self.ft.guard.skipped_total)
            log.warning("guard: step %d skipped (%s, loss %s, grad_norm %s); %d skipped so far", self.step,
                        verdict.reason, loss, grad_norm, self.ft.guard.skipped_total)
            if self.cfg.checkpoint.guard.triage:  # replay: data (quarantined) or hardware
                self.triaged = triage(self.engine, self.loader, batch, self.loader.consumed_samples
                                      - self.cfg.train.global_batch_size, self.ft.guard, self.device, grads)
                self.log_record(self.triaged.record(self.step, len(self.loader.quarantine)))
        record.update(self.engine.extra_metrics() | self.mixer.metrics())
        record.update(self.observer.on_step(record))
        return record

    def evaluate(self) -> dict[str, float]:
        """Validation loss per domain on its held-out split (the same batches every time)."""
        out: dict[str, float] = {}
        for name, samples in self.data.val.items():
            per_rank = self.cfg.train.micro_batch_size * self.engine.dp_size
            loader = BatchLoader(samples, global_batch_size=per_rank, micro_batch_size=self.cfg.train.micro_batch_size,
                                 dp_rank=self.engine.dp_rank, dp_size=self.engine.dp_size)
            n = max(1, min(self.cfg.train.eval_batches, len(samples) // per_rank))
            losses = [self.engine.eval_loss(loader.next_batch()) for _ in range(n)]
            out[f"val_loss/{name}"] = float(np.mean(losses))
        if out:
            out["val_loss/mean"] = float(np.mean(list(out.values())))
        out.update(self.observer.eval_metrics(out))
        out.update(self.downstream.evaluate(self.engine, self.cfg.model, self.step))  # cfg.eval tasks
        return out

    def log_record(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)
        if record["type"] == "train" and (record["step"] % self.cfg.train.log_interval == 0
                                          or record["step"] == self.cfg.train.steps):
            log.info("step %5d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %7.0f tok/s  %.3fs/step",
                     record["step"], self.cfg.train.steps, record["loss"], record["lr"], record["grad_norm"],
                     record["tokens_per_s"], record["step_time_s"])
        elif record["type"] == "eval":
            log.info("eval step %d: %s", record["step"],
                     "  ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in record.items() if k.startswith("val_loss/")))

    def save(self, blocking: bool = False) -> None:
        """Checkpoint this step (in the background with checkpoint.async_save unless `blocking`)."""
        meta = {"loader": self.loader.state_dict(), "config": to_dict(self.cfg),
                "data_fingerprint": self.data.fingerprint, "guard": self.ft.guard.state_dict(),
                "data_build": self._data_build(), "engine": self.engine.extra_state(),
                **self._tokenizer_paths(),
                "batch_history": [list(h) for h in self.batch_history], "mixing": self.mixer.state_dict()}
        if self.ft.guard.skipping:  # taken right after a skipped step: never `latest`, never a rollback target
            meta["guard_suspect"] = True
            log.warning("checkpoint of step %d is taken while the loss guard is skipping steps: it is kept but "
                        "marked suspect and will not be resumed from or rolled back to", self.step)
        self.ft.manager.save(self.step, self.engine.model_parts, self.engine.optimizers, meta, blocking=blocking)

    def _should_save(self) -> bool:
        interval = self.cfg.checkpoint.interval
        if self.ft.guard.skipping and self.step != self.cfg.train.steps:
            return False  # the weights may be diverging: the next accepted step's interval save will do
        return (interval > 0 and self.step % interval == 0) or (
            self.step == self.cfg.train.steps and self.cfg.checkpoint.save_final)

    def _should_eval(self) -> bool:
        interval = self.cfg.train.eval_interval
        return bool(self.data.val) and interval > 0 and (self.step % interval == 0 or self.step == self.cfg.train.steps)

    def _timed_save(self, blocking: bool = False) -> float:
        """Save and log the time the loop spent on it (with async saves: the staging copy only)."""
        t_save = time.perf_counter()
        self.save(blocking=blocking)
        t_save = time.perf_counter() - t_save
        self.log_record({"type": "checkpoint", "step": self.step, "checkpoint_time_s": t_save})
        return t_save

    def _stop_for_requeue(self, result: TrainResult) -> float:
        """A stop signal reached some rank: make sure this step is committed, then report the exit code."""
        t_save = 0.0
        if self.ft.manager.last_saved_step != self.step:
            t_save = self._timed_save(blocking=True)
        self.ft.manager.wait()
        result.exit_code = self.ft.exit_code
        why = "requeue" if result.exit_code == self.cfg.checkpoint.requeue_exit_code else "interrupted: not requeued"
        log.warning("stopping at step %d on %s: checkpoint committed; exit code %d (%s); run the same command "
                    "again to resume", self.step, self.ft.stop_reason, result.exit_code, why)
        return t_save

    def train(self, stop_at: int | None = None) -> TrainResult:
        """Run (or resume) to `train.steps` — or stop early after step `stop_at`; returns a summary.

        Raises:
            ConfigError: another job is training in this run directory (its lock names the holder).
        """
        lock = DirLock(self.run_dir.path / ".lock", what="training job", error=ConfigError)
        if self.rank == 0:  # one lock per job: rank 0 holds it for all ranks
            lock.acquire()
        try:
            return self._train(stop_at)
        finally:
            lock.release()

    def _train(self, stop_at: int | None) -> TrainResult:
        if self.rank == 0:
            self.run_dir.write_config(dump_config(self.cfg))
        self.ft.manager.remove_partial_saves()
        self.resume()
        result = TrainResult(self.run_dir.path, self.step, self.step)
        times: list[float] = []
        ckpt_time = 0.0
        log.info("training %s from step %d to %d on %d rank(s), %s", self.cfg.run.name, self.step,
                 self.cfg.train.steps, self.world, self.device)
        end = min(self.cfg.train.steps, stop_at) if stop_at is not None else self.cfg.train.steps
        if self.step >= end:
            log.info("%s is already at step %d (target %d): nothing to train", self.cfg.run.name, self.step, end)
            for sink in self.sinks:
                sink.close()
            return result
        if self.step == 0 and self.cfg.eval.at_start and self.downstream.tasks:  # the untrained baseline
            self.log_record({"type": "eval", "step": 0, **self.downstream.evaluate(self.engine, self.cfg.model, 0)})
        with self.ft.running():
            while self.step < end:
                self._memory_due = len(times) == 1  # the second step of this start: see train_step
                record = self.train_step()
                result.losses[self.step] = record["loss"]
                times.append(record["step_time_s"])
                self.log_record(record)
                self.ft.step_done(self.step)
                if self.ft.guard.rollback_due:
                    self.rollback()
                    continue
                if (mixed := self.mixer.after_step(self.step, self.engine, self.loader)) is not None:
                    self.log_record(mixed)  # data.mixing=online: new weights from this sample on
                if self._should_eval():
                    result.eval = self.evaluate()
                    self.log_record({"type": "eval", "step": self.step, **result.eval})
                if self._should_save() or self.step == stop_at:
                    ckpt_time += self._timed_save(blocking=self.step == stop_at)
                if self.ft.stop_requested():
                    ckpt_time += self._stop_for_requeue(result)
                    break
        result.final_step = self.step
        if times:
            steady = times[1:] or times  # the first step pays one-off allocation costs
            result.mean_step_time_s = float(np.mean(steady))
            result.tokens_per_s = self.tokens_per_step / result.mean_step_time_s
        self.log_record(self.observer.summary(self.step, result.eval, ckpt_time))
        for sink in self.sinks:
            sink.close()
        return result

