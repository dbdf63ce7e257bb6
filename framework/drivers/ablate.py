"""`tessera ablate SPEC [--out DIR]`: data-mixture ablations — many scaled-down runs that differ only in weights.

A spec (YAML, see configs/ablations/) names a training config, the sources, the mixtures (an explicit list, a
simplex grid and/or Dirichlet samples), a fixed token budget and seeds. Every (mixture, seed) is one run in
`<out>/runs/<id>-s<seed>/`; a run that finished has `result.json` and is never rerun, a run that stopped midway
resumes from its checkpoint. Every run reads the same stdlib/`build` cache — the tokenizer and the per-source
.bin/.idx do not depend on the weights, and the held-out split is a function of each document's hash — so runs
differ only in how the training mixture is drawn. The report (framework/drivers/ablate_report.py) fits per-domain
loss against the weights and recommends a mixture.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from framework.base.errors import ConfigError
from framework.base.yaml_config import from_dict, load_yaml, replace, validate_tree
from framework.drivers.ablate_propose import ProposalSpec


@dataclass(kw_only=True, frozen=True)
class MixtureSpec:
    """Which mixtures to try; the three kinds add up (duplicates are dropped)."""

    explicit: list[dict[str, float]] = field(default_factory=list)
    """Weights by source; normalized to sum to 1; a source left out gets 0."""
    grid_step: float = 0.0
    """Every point of the simplex lattice with this spacing (e.g. 0.25); 0 adds none."""
    grid_min: float = 0.0
    """Grid points with a weight below this are left out (e.g. 0.1 to avoid starving a source)."""
    dirichlet: int = 0
    """Number of Dirichlet samples over the sources (the swarm a fit needs: a dozen or more)."""
    alpha: float = 1.0
    """Concentration without a prior: Dirichlet(alpha, ..., alpha)."""
    prior: dict[str, float] = field(default_factory=dict)
    """Swarm centre: with a prior, samples are Dirichlet(concentration x prior) (a source left out gets 0)."""
    concentration: float = 10.0
    """How tightly the swarm clusters around the prior (the Dirichlet's total concentration)."""
    min_weight: dict[str, float] = field(default_factory=dict)
    """Per-source lower bound of every sampled mixture (rejection sampling keeps the Dirichlet shape inside)."""
    max_weight: dict[str, float] = field(default_factory=dict)
    """Per-source upper bound of every sampled mixture."""
    seed: int = 0

    def validate(self) -> None:
        if not 0 <= self.grid_step < 1:
            raise ConfigError(f"mixtures.grid_step={self.grid_step} must be in [0, 1); e.g. 0.25 (0: no grid)")
        if self.grid_step and abs(round(1 / self.grid_step) * self.grid_step - 1) > 1e-9:
            raise ConfigError(f"mixtures.grid_step={self.grid_step} must divide 1; e.g. 0.5, 0.25, 0.2, 0.1")
        if self.dirichlet < 0 or self.alpha <= 0 or self.concentration <= 0:
            raise ConfigError(f"mixtures.dirichlet={self.dirichlet} must be >= 0, alpha={self.alpha} and "
                              f"concentration={self.concentration} > 0")
        if self.prior and (any(w < 0 for w in self.prior.values()) or sum(self.prior.values()) <= 0):
            raise ConfigError(f"mixtures.prior={self.prior} must be non-negative with a positive sum")
        lo, hi = sum(self.min_weight.values()), self.max_weight
        if lo > 1 or any(not 0 <= w <= 1 for w in [*self.min_weight.values(), *hi.values()]) or any(
                w < self.min_weight.get(s, 0.0) for s, w in hi.items()):
            raise ConfigError(f"mixtures.min_weight={self.min_weight} / max_weight={hi}: bounds must lie in "
                              f"[0, 1], min <= max per source and the minimums sum to <= 1")


@dataclass(kw_only=True, frozen=True)
class AblationSpec:
    name: str
    config: str
    """Training config to start from (relative to the spec file)."""
    sources: list[str]
    """Sources (domains) whose weights vary; each gets a per-domain validation loss."""
    mixtures: MixtureSpec = field(default_factory=MixtureSpec)
    token_budget: int
    """Training tokens per run (train.steps = ceil(budget / (global_batch_size x seq_len)))."""
    seeds: list[int] = field(default_factory=lambda: [0])
    overrides: list[str] = field(default_factory=list)
    """a.b.c=value overrides applied to every run (before the ablation's own)."""
    evals_per_run: int = 4
    """Evaluations per run (for the loss curves); the last one is at the final step."""
    objective: str = "mean"
    """What the recommendation minimizes: 'mean' (average per-domain validation loss) or a source name."""
    regression: Literal["log_linear", "linear"] = "log_linear"
    """Per-domain loss model: log_linear L_d = a + b·log(w_d + 0.01); linear L_d = a + Σ_j b_j·w_j."""
    proposal: ProposalSpec = field(default_factory=ProposalSpec)
    """Limits of the proposed mixture (target budget, epochs, weight box, KL bound) and its surrogate."""
    reuse: list[str] = field(default_factory=list)
    """Output directories of earlier ablations (other sources allowed): their runs join the per-domain fits for the
    domains they evaluated (framework/drivers/ablate_reuse.py)."""

    def validate(self) -> None:
        if not self.sources or len(set(self.sources)) != len(self.sources):
            raise ConfigError(f"sources={self.sources} must list distinct sources, e.g. [code, prose, tests]")
        if self.objective != "mean" and self.objective not in self.sources:
            raise ConfigError(f"objective={self.objective!r} must be 'mean' or one of sources {self.sources}")
        if self.token_budget < 1 or not self.seeds or self.evals_per_run < 1:
            raise ConfigError(f"token_budget={self.token_budget}, seeds={self.seeds}, evals_per_run="
                              f"{self.evals_per_run}: need a positive budget, >= 1 seed and >= 1 evaluation")
        m, p = self.mixtures, self.proposal
        for where, named in (("mixtures.prior", m.prior), ("mixtures.min_weight", m.min_weight),
                             ("mixtures.max_weight", m.max_weight), ("proposal.max_epochs", p.max_epochs),
                             ("proposal.min_weight", p.min_weight), ("proposal.max_weight", p.max_weight),
                             ("proposal.prior", p.prior)):
            if set(named) - set(self.sources):
                raise ConfigError(f"{where}={named} names sources outside sources={self.sources}")
        for i, mix in enumerate(self.mixtures.explicit):
            unknown = set(mix) - set(self.sources)
            if unknown or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
                raise ConfigError(f"mixtures.explicit[{i}]={mix} must have non-negative weights over sources "
                                  f"{self.sources} with a positive sum")


def load_spec(path: str | Path, extra_overrides: Sequence[str] = ()) -> tuple[AblationSpec, Path]:
    """The spec at `path` (strictly checked; `extra_overrides` appended to its overrides) and its config path."""
    path = Path(path)
    spec = from_dict(AblationSpec, load_yaml(path), "")
    if extra_overrides:
        spec = replace(spec, overrides=[*spec.overrides, *extra_overrides])
    validate_tree(spec)
    config = (path.parent / spec.config) if not Path(spec.config).is_absolute() else Path(spec.config)
    if not config.is_file():
        config = Path(spec.config)  # relative to the working directory instead
    if not config.is_file():
        raise ConfigError(f"{path}: config={spec.config!r} is neither relative to the spec nor to the working "
                          f"directory; point it at a training config such as configs/smoke/smoke.yaml")
    return spec, config


def simplex_grid(k: int, step: float) -> np.ndarray:
    """All points of the k-simplex whose coordinates are multiples of `step`, as rows."""
    n = round(1 / step)
    out: list[list[int]] = []

    def rec(prefix: list[int], left: int) -> None:
        if len(prefix) == k - 1:
            out.append([*prefix, left])
            return
        for i in range(left + 1):
            rec([*prefix, i], left - i)

    rec([], n)
    return np.asarray(out, dtype=np.float64) / n


def mixture_list(spec: AblationSpec) -> list[dict[str, float]]:
    """The mixtures of a spec, normalized, in a fixed order: explicit, then grid, then Dirichlet samples."""
    src, m = spec.sources, spec.mixtures
    rows = [np.asarray([mix.get(s, 0.0) for s in src], dtype=np.float64) for mix in m.explicit]
    if m.grid_step:
        rows += [r for r in simplex_grid(len(src), m.grid_step) if (r >= m.grid_min - 1e-12).all()]
    if m.dirichlet:
        rows += list(swarm(spec))
    out, seen = [], set()
    for r in rows:
        r = r / r.sum()
        key = tuple(np.round(r, 6))
        if key not in seen:
            seen.add(key)
            out.append({s: round(float(w), 6) for s, w in zip(src, r)})
    if not out:
        raise ConfigError(f"ablation {spec.name!r} has no mixtures; add mixtures.explicit, grid_step or dirichlet")
    return out


def swarm(spec: AblationSpec) -> np.ndarray:
    """`mixtures.dirichlet` mixtures (rows) drawn from Dirichlet(concentration x prior), or Dirichlet(alpha) without
    a prior, kept only inside the per-source [min_weight, max_weight] box (rejection, so the shape inside the box
    is the Dirichlet's); reproducible from `mixtures.seed`."""
    src, m = spec.sources, spec.mixtures
    if m.prior:
        p = np.array([m.prior.get(s, 0.0) for s in src])
        alpha = m.concentration * p / p.sum()
    else:
        alpha = np.full(len(src), m.alpha)
    lo = np.array([m.min_weight.get(s, 0.0) for s in src])
    hi = np.array([m.max_weight.get(s, 1.0) for s in src])
    rng = np.random.default_rng(m.seed)
    pos = alpha > 0  # a source with prior 0 stays at 0
    kept: list[np.ndarray] = []
    for _ in range(200):
        draw = np.zeros((4 * m.dirichlet, len(src)))
        draw[:, pos] = rng.dirichlet(alpha[pos], size=len(draw))
        kept += [r for r in draw if ((r >= lo - 1e-12) & (r <= hi + 1e-12)).all()]
        if len(kept) >= m.dirichlet:
            return np.asarray(kept[:m.dirichlet])
    raise ConfigError(f"mixtures: fewer than {m.dirichlet} of {200 * 4 * m.dirichlet} Dirichlet draws fell inside "
                      f"min_weight={m.min_weight} / max_weight={m.max_weight}; widen the bounds, move the prior "
                      f"inside them or lower the concentration")


@dataclass(frozen=True)
class RunPlan:
    """One run of the ablation."""

    index: int
    mixture_id: str
    seed: int
    weights: dict[str, float]
    path: Path
    overrides: list[str]

    @property
    def result_file(self) -> Path:
        return self.path / "result.json"

    def finished(self) -> bool:
        """True when result.json exists for the same weights, seed and overrides (a changed spec reruns)."""
        if not self.result_file.is_file():
            return False
        got = json.loads(self.result_file.read_text())
        return bool(got.get("weights") == self.weights and got.get("overrides") == self.overrides)


def plan_runs(spec: AblationSpec, config_path: Path, out: Path) -> list[RunPlan]:
    """Every (mixture, seed) run with the overrides that make it: weights, seed, steps, evals, run dir."""
    plans: list[RunPlan] = []
    for i, weights in enumerate(mixture_list(spec)):
        plans += _seed_runs(spec, config_path, out, f"m{i:02d}", weights, len(plans))
    return plans


def confirm_runs(spec: AblationSpec, config_path: Path, out: Path, weights: dict[str, float]) -> list[RunPlan]:
    """The proposal trained like every proxy (same budget, seeds and overrides): `<out>/runs/confirm-s<seed>`."""
    return _seed_runs(spec, config_path, out, "confirm", {s: round(w, 6) for s, w in weights.items()}, 0)


def _seed_runs(spec: AblationSpec, config_path: Path, out: Path, mid: str, weights: dict[str, float],
               first: int) -> list[RunPlan]:
    from framework.config import load_config

    base = load_config(config_path, spec.overrides)
    tokens_per_step = base.train.global_batch_size * base.data.seq_len
    steps = max(1, math.ceil(spec.token_budget / tokens_per_step))
    eval_interval = max(1, steps // spec.evals_per_run)
    full = {s: weights.get(s, 0.0) for s in spec.sources}
    plans: list[RunPlan] = []
    for seed in spec.seeds:
        name = f"{mid}-s{seed}"
        path = out / "runs" / name
        ov = [*spec.overrides, f"data.weights={json.dumps(full)}", f"train.seed={seed}", f"data.seed={seed}",
              f"train.steps={steps}", f"train.eval_interval={eval_interval}",
              f"train.warmup_steps={min(base.train.warmup_steps, steps // 5)}",
              f"run.name={spec.name}-{name}", f"run.dir={path}", f"observe.wandb.group={spec.name}"]
        plans.append(RunPlan(first + len(plans), mid, seed, full, path, ov))
    return plans


def source_tokens(train: object, seq_len: int) -> dict[str, int]:
    """Training tokens each source holds (its packed training samples x seq_len): what the proposal's epoch limit
    divides by. Empty for data without named sources (synthetic)."""
    names, sources = getattr(train, "names", []), getattr(train, "sources", [])
    return {n: len(s) * seq_len for n, s in zip(names, sources, strict=True)}


def run_one(plan: RunPlan, config_path: Path) -> dict[str, Any]:
    """Train (or resume) one run and write its result.json; returns the result."""
    from framework.checkpoint.signals import check_stopped
    from framework.config import load_config
    from framework.train.trainer import Trainer

    cfg = load_config(config_path, plan.overrides)
    trainer = Trainer(cfg)
    result = trainer.train()
    check_stopped(result.exit_code, f"ablation run {plan.path.name}")  # not on to the next run: SLURM requeues
    if not result.eval and trainer.data.val:
        # Resumed at the final step (it crashed after its last checkpoint but before result.json): evaluate now.
        result.eval = trainer.evaluate()
    out = {"mixture_id": plan.mixture_id, "seed": plan.seed, "weights": plan.weights, "overrides": plan.overrides,
           "final_step": result.final_step, "tokens": result.final_step * trainer.tokens_per_step,
           "val": {k: v for k, v in result.eval.items() if k.startswith("val_loss/")},
           # What must not change across mixtures: the same tokenizer file and the same held-out split.
           "tokenizer_path": trainer.data.tokenizer_path, "build_dir": getattr(trainer.data, "build_dir", None),
           "val_samples": {k: len(v) for k, v in trainer.data.val.items()},
           "train_tokens": source_tokens(trainer.data.train, cfg.data.seq_len)}
    if not out["val"]:
        raise ConfigError(f"run {plan.path} produced no validation loss; the data has no held-out split "
                          f"(data.val_fraction > 0 needed)")
    tmp = plan.result_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(plan.result_file)
    return out


def run_ablation(spec_path: str | Path, out: str | Path, index: int | None = None,
                 extra_overrides: Sequence[str] = ()) -> list[RunPlan]:
    """Run every unfinished run of the spec one after another (or only run `index`); returns the plans."""
    from tqdm import tqdm

    spec, config_path = load_spec(spec_path, extra_overrides)
    out = Path(out)
    plans = plan_runs(spec, config_path, out)
    if index is not None:
        if not 0 <= index < len(plans):
            raise ConfigError(f"--index {index} is out of range; this ablation has runs 0..{len(plans) - 1}")
        todo = [plans[index]]
    else:
        todo = plans
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps([{"index": p.index, "run": p.path.name, "weights": p.weights,
                                                "seed": p.seed} for p in plans], indent=1))
    for plan in tqdm(todo, desc=f"ablate {spec.name}", unit="run", disable=None):
        if plan.finished():
            continue
        run_one(plan, config_path)
    return plans
