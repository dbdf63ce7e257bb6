"""A fixed handful of bench/mutation.py's mutants of five pure modules (the loss guard, the resume rules, the
planner's traffic model, the pipeline-schedule table, the loss scaler), each run in process against the module's
own fast tests: every one must be killed. A rewrite that makes a test unable to fail, or a mutant the tests
stopped seeing, shows here in CI; the full bench (bench/mutation.py, docs/BENCHMARKS.md) covers the rest. Each
mutant is named by its operator and source text, not its line, so edits elsewhere in the module do not move it."""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "checkpoint"))
sys.path.insert(0, str(REPO / "tests" / "plan"))
sys.path.insert(0, str(REPO / "tests" / "parallel"))
sys.path.insert(0, str(REPO / "tests" / "framework"))

from bench.mutation import Mutant, apply, mutants  # noqa: E402

GUARD, RULES, COMM = "framework/checkpoint/guard.py", "framework/checkpoint/resume_rules.py", "framework/plan/comm.py"
SCHED, SCALER = "framework/parallel/pipeline_schedules.py", "framework/numerics/precision.py"
FIXED: list[tuple[str, str, str]] = [  # (module, operator, source text the mutant changes)
    (GUARD, "compare", "z > self.cfg.zscore"),
    (GUARD, "compare", "self.consecutive >= self.cfg.max_consecutive"),
    (GUARD, "compare", "self.rollbacks >= self.cfg.max_rollbacks"),
    (GUARD, "return", "self.consecutive = 0"),
    (GUARD, "compare", "len(self.history) < self.cfg.min_history"),
    (RULES, "compare", "old_steps == new_steps"),
    (RULES, "compare", "old_gbs != new_gbs"),
    (RULES, "negate", "not cfg.allow_data_change"),
    (RULES, "compare", 'int(p.get("start_step", 0)) <= step'),
    # the planner's traffic model: each survived the first bench run until tests/plan/test_plan_comm_hand.py
    (COMM, "arith", 'm * ring_factor("all_gather", n)'),
    (COMM, "arith", "work.model.moe.top_k * tokens * work.model.hidden * work.precision.act"),
    (COMM, "arith", "group - 1"),
    (COMM, "arith", "work.seq_len // lay.cp"),
    # the in-flight flag (which ranks hold more than 1F1B's p - r): survived until test_in_flight_vs_torch.py
    (SCHED, "negate", "False"),
    (SCHED, "negate", "True"),
    (SCHED, "arith", "m + 1 + rank"),
    # a resume across precisions: survived until test_loss_scale_state_rules.py
    (SCALER, "boolop", "self.enabled and state"),
]
CONTEXT = {  # source text on the mutant's line, where its own text occurs more than once in the module
    (SCHED, "negate", "False"): "every_rank_in_flight: bool = False",
    (SCHED, "negate", "True"): "in_flight=_all_micro, every_rank_in_flight=True",
}


def _find(module: str, op: str, before: str) -> Mutant:
    lines = (REPO / module).read_text().splitlines()
    context = CONTEXT.get((module, op, before), "")
    found = [m for m in mutants(module, 0) if m.op == op and m.before == before and context in lines[m.line - 1]]
    assert found, f"no {op} mutant of {before!r} in {module}: the source changed; pick another fixed mutant"
    return found[0]


def _load(module: str, source: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The mutated module, installed under its real name for the duration of the test."""
    name = module.removesuffix(".py").replace("/", ".")
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    mod.__file__ = str(REPO / module)
    monkeypatch.setitem(sys.modules, name, mod)
    exec(compile(source, str(REPO / module), "exec"), mod.__dict__)
    return mod


def _guard_tests(mod: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp: Path) -> list[Callable[[], None]]:
    import test_ckpt_safety
    import test_ckpt_units

    monkeypatch.setattr(test_ckpt_units, "LossGuard", mod.LossGuard)
    return [test_ckpt_units.test_guard_skips_nonfinite_and_spikes_then_asks_for_rollback,
            lambda: test_ckpt_safety.test_rollback_refusals_and_suspect_checkpoints(tmp)]


def _rules_tests(mod: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp: Path) -> list[Callable[[], None]]:
    import test_resume_fewer_steps
    import test_resume_rules

    monkeypatch.setattr(test_resume_rules, "check_resume", mod.check_resume)
    monkeypatch.setattr(test_resume_fewer_steps, "check_resume", mod.check_resume)
    names = ["test_allowed_silently_eval_logging_and_checkpoint_settings",
             "test_train_steps_needs_the_flag_that_says_how_the_lr_continues", "test_global_batch_size_needs_a_flag",
             "test_new_future_schedule_phase_is_allowed_but_not_a_seen_one",
             "test_data_seen_and_model_shape_are_refused",
             "test_batch_size_change_with_data_schedule_needs_only_its_own_flag"]
    return [*(getattr(test_resume_rules, n) for n in names),
            test_resume_fewer_steps.test_fewer_steps_needs_the_flag_on_crafted_metadata]


def _comm_tests(mod: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp: Path) -> list[Callable[[], None]]:
    import test_plan_comm_hand as hand

    monkeypatch.setattr(hand, "dp_comm_per_step", mod.dp_comm_per_step)
    monkeypatch.setattr(hand, "ep_comm_per_micro", mod.ep_comm_per_micro)  # tp_comm_per_micro: imported per call
    return [hand.test_hpz_gathers_forward_over_the_shard_group_and_backward_over_the_node,
            hand.test_zeropp_leaves_the_experts_reduction_plain, hand.test_expert_all_to_all_bytes_by_hand,
            hand.test_no_data_parallelism_moves_nothing,
            hand.test_tensor_parallel_under_context_parallel_and_the_ring_latency]


def _schedule_tests(mod: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp: Path) -> list[Callable[[], None]]:
    import test_in_flight_vs_torch as ref  # torch's action tables are cached there: one build for all mutants

    monkeypatch.setattr(ref, "SCHEDULES", mod.SCHEDULES)
    monkeypatch.setattr(ref, "rank_in_flight", mod.rank_in_flight)
    return [functools.partial(ref.test_every_rank_holds_what_torch_holds, name)
            for name in ("1F1B", "LoopedBFS", "ZBVZeroBubble")]


def _scaler_tests(mod: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp: Path) -> list[Callable[[], None]]:
    import test_loss_scale_state_rules as rules

    monkeypatch.setattr(rules, "LossScaler", mod.LossScaler)
    return [rules.test_an_fp16_run_without_a_saved_scale_starts_from_its_configured_one,
            rules.test_a_bf16_run_ignores_an_fp16_checkpoints_scale_as_grad_scaler_does]


TESTS = {GUARD: _guard_tests, RULES: _rules_tests, COMM: _comm_tests, SCHED: _schedule_tests, SCALER: _scaler_tests}


def _killed(module: str, source: str, monkeypatch: pytest.MonkeyPatch, tmp: Path) -> bool:
    with monkeypatch.context() as mp:
        mod = _load(module, source, mp)
        for test in TESTS[module](mod, mp, tmp):
            try:
                tmp.mkdir(parents=True, exist_ok=True)
                test()
            except (Exception, pytest.fail.Exception):  # an assertion, pytest.raises not raising, or a crash
                return True
    return False


def test_the_unmutated_modules_pass_their_tests(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for module in TESTS:  # the harness itself: the real source, loaded the same way, is not "killed"
        assert not _killed(module, (REPO / module).read_text(), monkeypatch, tmp_path / module.replace("/", "_"))


@pytest.mark.parametrize(("module", "op", "before"), FIXED, ids=[f"{m.split('/')[-1]}:{b}" for m, _, b in FIXED])
def test_fixed_mutant_is_killed(module: str, op: str, before: str, monkeypatch: pytest.MonkeyPatch,
                                tmp_path: Path) -> None:
    m = _find(module, op, before)
    assert _killed(module, apply((REPO / module).read_text(), m), monkeypatch, tmp_path), (
        f"mutant survived: {module}:{m.line} {m.before!r} -> {m.after!r}")
