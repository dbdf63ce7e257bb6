"""Operations must-shows on 4 gloo ranks, in one process-group spawn:

- straggler: a rank slowed by observe.straggler.inject is named (rank, section, slowdown) within
  interval x persist steps; a healthy run with the same fixed seed names nobody;
- spike triage: a planted poisoned batch is classified as data, quarantined, skipped after the rollback and after a
  resume in a new Trainer, and the losses equal a run whose data never held it; a NaN injected once on one rank is
  classified as hardware, nothing is quarantined, and every rank holds the same verdicts;
- sniff: the rank whose GEMM is slowed is named with its figure, the same on every rank; as a training run's
  start check (observe.sniff.at_start) with observe.exclude on, it names the node in exclude.json and every rank
  commits a checkpoint and stops with the requeue code after the first step;
- hang: one rank late to a collective; the hang watchdog's flight-recorder dumps let `doctor` name the collective,
  the group and the missing rank.
"""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from data_pipeline.read.loader import BatchLoader, SyntheticSamples
from framework.base.run_dir import RunDir
from framework.checkpoint.watchdog import Watchdog
from framework.cli import cmd_sniff, main
from framework.observe.doctor import diagnose
from framework.observe.exclusion import read_exclusions
from framework.observe.sniff import sniff
from framework.testing import run_distributed
from framework.testing.tiny import tiny_config
from framework.train.local_engine import LocalEngine
from framework.train.trainer import Trainer

pytestmark = [pytest.mark.distributed]

DP4 = ("parallel.dp_replicate=4", "parallel.zero_stage=0", "train.global_batch_size=8", "train.micro_batch_size=2")
INTERVAL, PERSIST = 2, 3


def _straggler(rank: int, base: Path, name: str, steps: int, *extra: str) -> list[dict[str, Any]]:
    cfg = tiny_config(base / name, *DP4, f"train.steps={steps}", "checkpoint.interval=0", "data.seed=11",
                      f"observe.straggler.interval={INTERVAL}", f"observe.straggler.persist={PERSIST}", *extra)
    Trainer(cfg).train()
    return RunDir(base / name).read_metrics("train") if rank == 0 else []


VOCAB, POISON_TOKEN = 512, 511
POISONED = range(40, 48)  # the global batch of step 6 (global batch 8)


class _Clean:
    """tiny.yaml's synthetic samples without the poison token; `drop` removes the poisoned indices altogether."""

    def __init__(self, drop: bool) -> None:
        self.base, self.drop = SyntheticSamples(VOCAB, 32, seed=1234), drop

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i) + (len(POISONED) if self.drop and i >= POISONED.start else 0)
        row = self.base[i]
        return np.where(row == POISON_TOKEN, 0, row)


class _Poisoned(_Clean):
    def __getitem__(self, i: int) -> np.ndarray:
        row = super().__getitem__(i)
        if int(i) in POISONED:
            row[5] = POISON_TOKEN
        return row


def _trainer(run: Path, samples: Any, steps: int, *extra: str) -> Trainer:
    """A DP4 trainer on `samples` whose model turns the poison token's embedding into NaN: a model that
    deterministically diverges on some data, as a real spike-inducing batch does."""
    t = Trainer(tiny_config(run, *DP4, f"train.steps={steps}", "checkpoint.interval=4",
                            "observe.straggler.enabled=false", *extra))
    t.loader.samples = samples
    emb = t.engine.model_parts[0].tok_embeddings
    emb.register_forward_hook(lambda m, a, out: out.masked_fill((a[0] == POISON_TOKEN).unsqueeze(-1), float("nan")))
    return t


def _triage_cases(rank: int, base: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"reference": _trainer(base / "ref", _Clean(drop=True), 10).train().losses}
    poisoned = _trainer(base / "poison", _Poisoned(drop=False), 10, "checkpoint.guard.max_consecutive=1")
    out["poisoned"] = poisoned.train(stop_at=8).losses
    out["quarantine"] = [int(i) for i in poisoned.loader.quarantine]
    resumed = _trainer(base / "poison", _Poisoned(drop=False), 10)
    out["resumed"] = resumed.train().losses
    out["resumed_quarantine"] = [int(i) for i in resumed.loader.quarantine]
    hw = _trainer(base / "hw", _Clean(drop=False), 5)
    calls = [0]

    def nan_once(m: Any, a: Any, y: torch.Tensor) -> torch.Tensor:  # rank 1, the third training forward only
        calls[0] += 1
        return y * float("nan") if rank == 1 and calls[0] == 3 else y

    hw.engine.model_parts[0].tok_embeddings.register_forward_hook(nan_once)
    out["hardware"] = hw.train().losses
    out["hardware_quarantine"] = [int(i) for i in hw.loader.quarantine]
    out["layer_rms"] = {"poison": poisoned.triaged.layer_rms, "hw": hw.triaged.layer_rms}  # type: ignore[union-attr]
    out["triage"] = {name: RunDir(base / name).read_metrics("triage") for name in ("poison", "hw")} if rank == 0 else {}
    return out


class _KeptWatchdog(Watchdog):
    """The hang watchdog, firing once and keeping the process (the test's late rank arrives after the dumps)."""

    def exit_now(self, after_s: float = 0.0) -> None:
        self._stop.set()


def _hang_case(rank: int, base: Path) -> None:
    group = dist.new_group(list(range(4)), group_desc="dp")
    dist.all_reduce(torch.ones(1), group=group)  # collective #1: every rank issued it
    watchdog = _KeptWatchdog(1.0, base / "hang" / "stacks", rank, exit_code=42).start()
    if rank == 3:
        time.sleep(5.0)  # rank 3 is stuck outside any collective (a slow read) while its peers wait in #2
    dist.all_reduce(torch.ones(1), group=group)
    watchdog.stop()


def _sniff_exclude(rank: int, base: Path) -> dict[str, Any]:
    cfg = tiny_config(base / "sniffex", *DP4, "train.steps=4", "checkpoint.interval=0",
                      "observe.straggler.enabled=false", "observe.sniff.at_start=true",
                      "observe.sniff.inject=1:gemm:0.03", "observe.exclude.enabled=true")
    result = Trainer(cfg).train()
    records = RunDir(base / "sniffex").read_metrics("train") if rank == 0 else []
    return {"exit_code": result.exit_code, "final_step": result.final_step, "records": records}


def _layer_grads(rank: int, base: Path) -> dict[str, Any]:
    """Per-layer gradient norms of the FSDP engine (4 shards: each element on one rank) and of the 1-process engine
    on the same global batch."""
    t = Trainer(tiny_config(base / "grads", *DP4, "parallel.dp_replicate=1", "parallel.zero_stage=3", "train.steps=4",
                            "observe.straggler.enabled=false"))
    t.engine.forward_backward(t.loader.next_batch())
    parallel = t.engine.layer_grad_norms(t.engine.clip_grad_norm(0.0))
    t.engine.optimizer_step(1e-3, apply=False)
    local = LocalEngine(t.cfg.model, t.cfg.train, torch.device("cpu"))
    local.forward_backward(BatchLoader(t.data.train, global_batch_size=8, micro_batch_size=2, dp_rank=0,
                                       dp_size=1).next_batch())
    return {"parallel": parallel, "local": local.layer_grad_norms(local.clip_grad_norm(1e-3))}  # clipped hard


def _body(rank: int, world: int, base: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    _hang_case(rank, base)
    out: dict[str, Any] = _triage_cases(rank, base)
    out["sniff_exclude"] = _sniff_exclude(rank, base)
    out["layer_grads"] = _layer_grads(rank, base)
    out["sniff_cli"] = cmd_sniff(argparse.Namespace(gemm_n=64, numel=1024, stride=2))  # `tessera sniff`, launched
    out["sniff"] = sniff(torch.device("cpu"), gemm_n=128, comm_numel=4096, repeats=3,
                         slow_gemm_s=0.03 if rank == 1 else 0.0).slow
    out["slow_forward"] = _straggler(rank, base, "slow_fwd", 8, "observe.straggler.inject=2:forward:0.08")
    out["slow_optimizer"] = _straggler(rank, base, "slow_opt", 8, "observe.straggler.inject=1:optimizer:0.08")
    out["healthy"] = _straggler(rank, base, "healthy", 30)
    return out


@pytest.fixture(scope="module")
def ops_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("ops")
    results = run_distributed(_body, 4, timeout_s=300, base=base, env={"TORCH_FR_BUFFER_SIZE": "64"})
    return {"base": base, "ranks": results}


def _named(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in records if "straggler/rank" in r), None)


@pytest.mark.parametrize(("case", "rank", "section"), [("slow_forward", 2, "forward"),
                                                       ("slow_optimizer", 1, "optimizer")])
def test_a_slowed_rank_is_named_with_its_section_within_interval_x_persist_steps(
        ops_results: dict[str, Any], case: str, rank: int, section: str) -> None:
    named = _named(ops_results["ranks"][0][case])
    assert named is not None, "the slowed rank was never named"
    assert (named["straggler/rank"], named["straggler/section"]) == (rank, section)
    assert named["step"] <= INTERVAL * PERSIST and named["straggler/slowdown"] > 1.3
    assert named["straggler/host"]


def test_a_healthy_run_names_nobody(ops_results: dict[str, Any]) -> None:
    records = ops_results["ranks"][0]["healthy"]
    assert len(records) == 30 and sum("straggler/max_score" in r for r in records) == 30 // INTERVAL
    assert _named(records) is None, _named(records)


def test_a_poisoned_batch_is_data_quarantined_and_skipped_after_rollback_and_resume(
        ops_results: dict[str, Any]) -> None:
    ranks = ops_results["ranks"]
    ref = ranks[0]["reference"]
    (tri,) = ranks[0]["triage"]["poison"]
    assert (tri["step"], tri["verdict"], tri["quarantined"]) == (6, "data", list(POISONED))
    assert all(r["quarantine"] == r["resumed_quarantine"] == list(POISONED) for r in ranks)  # every rank agrees
    # after the rollback to step 4 and after a new Trainer's resume at step 8: the losses of a run without them
    losses = {**ranks[0]["poisoned"], **ranks[0]["resumed"]}
    assert sorted(losses) == sorted(ref) == list(range(1, 11))
    torch.testing.assert_close(torch.tensor([losses[s] for s in ref]), torch.tensor(list(ref.values())),
                               rtol=0, atol=1e-6)


def test_a_one_rank_nan_that_does_not_come_back_is_hardware_and_quarantines_nothing(
        ops_results: dict[str, Any]) -> None:
    ranks = ops_results["ranks"]
    (tri,) = ranks[0]["triage"]["hw"]
    assert (tri["step"], tri["verdict"], tri["quarantined"]) == (3, "hardware", [])
    assert tri["replay_same_loss"] == pytest.approx(ranks[0]["reference"][3], abs=0.5)  # a finite, ordinary loss
    assert all(r["hardware_quarantine"] == [] for r in ranks)
    assert all(repr(r["hardware"]) == repr(ranks[0]["hardware"]) for r in ranks)  # the same losses, NaN at step 3


def test_the_spike_replay_saves_every_layers_activation_rms_for_doctor(ops_results: dict[str, Any]) -> None:
    ranks, n_layers = ops_results["ranks"], tiny_config(ops_results["base"] / "x").model.n_layers
    hw = ranks[0]["layer_rms"]["hw"]  # a clean replay: every block's output is finite, every rank holds the same
    assert len(hw) == n_layers and all(0 < v < 100 for v in hw) and len(set(hw)) == n_layers, hw
    assert all(r["layer_rms"] == ranks[0]["layer_rms"] for r in ranks)
    (tri,) = ranks[0]["triage"]["poison"]  # the poisoned rows' NaN embedding runs through every block
    assert ranks[0]["layer_rms"]["poison"] == [float("inf")] * n_layers
    assert tri["layer_act_rms"] == [None] * n_layers  # metrics.jsonl writes a non-finite value as null
    (poison,) = [f for f in diagnose(ops_results["base"] / "poison") if "largest activations" in f.summary]
    assert poison.summary.startswith("spike at step 6 (data): largest activations in layer(s) 0, 1, 2;"), poison
    (found,) = [f for f in diagnose(ops_results["base"] / "hw") if "largest activations" in f.summary]
    top = ", ".join(map(str, sorted(range(n_layers), key=lambda i: -hw[i])[:3]))
    assert found.summary.startswith(f"spike at step 3 (hardware): largest activations in layer(s) {top}; "), found
    assert len(tri["layer_grad_norm"]) == n_layers + 1  # the blocks, then the rest


def test_per_layer_gradient_norms_match_the_one_process_engine_before_clipping(ops_results: dict[str, Any]) -> None:
    for r in ops_results["ranks"]:
        parallel, local = r["layer_grads"]["parallel"], r["layer_grads"]["local"]
        assert len(parallel) == len(local) and min(parallel) > 0, (parallel, local)
        torch.testing.assert_close(torch.tensor(parallel), torch.tensor(local), rtol=1e-4, atol=0)


def test_doctor_names_the_hung_collective_its_group_and_the_missing_rank(ops_results: dict[str, Any]) -> None:
    (hang,) = [f for f in diagnose(ops_results["base"] / "hang") if f.topic == "hang"]
    assert hang.summary.endswith("flight record: in all_reduce on group dp: rank(s) 3 never issued it"), hang
    assert any("ranks [0, 1, 2] wait in it; never issued by rank 3 (last seq 1)" in e for e in hang.evidence)
    assert hang.summary.startswith("hung: rank 3 (") and "is behind" in hang.summary  # the stacks agree


def test_sniff_names_the_rank_with_the_slow_gemm_on_every_rank(ops_results: dict[str, Any]) -> None:
    ranks = ops_results["ranks"]
    worst = ranks[0]["sniff"][0]
    assert (worst["rank"], worst["test"]) == (1, "gemm") and worst["seconds"] >= 0.03 and worst["slowdown"] > 3
    assert all(r["sniff"] == ranks[0]["sniff"] for r in ranks)
    assert len({r["sniff_cli"] for r in ranks}) == 1 and ranks[0]["sniff_cli"] in (0, 1)  # one verdict, every rank


def test_a_sniff_failure_at_start_excludes_its_node_and_stops_for_a_requeue(ops_results: dict[str, Any]) -> None:
    ranks = ops_results["ranks"]
    assert all((r["sniff_exclude"]["exit_code"], r["sniff_exclude"]["final_step"]) == (42, 1) for r in ranks)
    (record,) = ranks[0]["sniff_exclude"]["records"]
    assert (record["sniff/rank"], record["sniff/test"]) == (1, "gemm") and record["exclude/reason"] == "sniff"
    run = ops_results["base"] / "sniffex"
    entry = read_exclusions(run)["nodes"][socket.gethostname()]
    assert (entry["reason"], entry["by"], entry["step"]) == ("sniff", "policy", 1)
    assert (entry["evidence"]["rank"], entry["evidence"]["test"]) == (1, "gemm") and entry["evidence"]["slowdown"] > 3
    assert (run / "checkpoints" / "step_1").is_dir()  # committed before the stop: the requeued job resumes there


def test_sniff_on_one_process_says_how_to_launch_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sniff"]) != 0
    assert "launch it on >= 3 ranks" in capsys.readouterr().err
