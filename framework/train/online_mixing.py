"""Online data mixing (`data.mixing: online`): the trainer's side of the rule in data_pipeline/read/doremi.py.

    mixer = OnlineMixer(cfg.data, cfg.train, data, dp_rank, dp_size)
    record = mixer.after_step(step, engine, loader)     # every data.online.interval steps: an update record

Every `interval` optimizer steps each mixed domain's loss is measured on the first `eval_samples` samples of its
held-out split (the same set at every world size; the engine all-reduces the mean), the weights take one DoReMi
step, and the mixture gains a phase that starts at the loader's position with the new weights
(`MixtureSamples.with_phases`: everything before it maps to the samples already read). The phases are the whole
state: they go into every checkpoint (meta.json `mixing`), and a resume rebuilds the same mixture from them, so a
stopped run reads bitwise what the uninterrupted one read. The weights in force are logged with every train
record (`mix/<domain>`), each update as a `mixing` record (docs/METRICS.md).
"""

from __future__ import annotations

from typing import Any

from data_pipeline.config import DataConfig
from data_pipeline.read.doremi import doremi_update
from data_pipeline.read.loader import BatchLoader
from data_pipeline.read.mixing import MixtureSamples
from framework.base.errors import ConfigError, DataError
from framework.base.logs import get_logger
from framework.engine import Engine
from framework.train.config import TrainConfig

log = get_logger("mixing")


class OnlineMixer:
    """Owns the online phases of one run; inert (every method a no-op) under `data.mixing: static`.

    Args:
        cfg: The data section.
        train_cfg: The train section (batch sizes, steps).
        data: The prepared data (`PreparedData`): its training mixture and held-out splits.
        dp_rank: This rank's data-parallel index.
        dp_size: Data-parallel ranks.

    Raises:
        ConfigError: eval_samples is not a multiple of micro_batch_size x dp_size, or the run is longer than one
            pass of the mixture.
        DataError: a mixed domain has fewer held-out samples than eval_samples.
    """

    def __init__(self, cfg: DataConfig, train_cfg: TrainConfig, data: Any, dp_rank: int, dp_size: int) -> None:
        self.enabled = cfg.mixing == "online"
        self.cfg, self.online = cfg, cfg.online
        self.micro, self.dp_rank, self.dp_size = train_cfg.micro_batch_size, dp_rank, dp_size
        self.base: MixtureSamples | None = data.train if self.enabled else None
        self.val = data.val
        self.phases: list[tuple[int, int, dict[str, float]]] = []
        """(after step, start sample, weights) of every update so far."""
        self.weights = self._initial_weights()
        if self.enabled:
            self._check(train_cfg)

    def _check(self, train_cfg: TrainConfig) -> None:
        per_step = self.micro * self.dp_size
        m = self.online.eval_samples
        if m % per_step:
            fix = max(1, round(m / per_step)) * per_step
            raise ConfigError(f"data.online.eval_samples={m} must be a multiple of train.micro_batch_size x "
                              f"data-parallel size = {self.micro} x {self.dp_size}; set it to e.g. {fix}")
        assert isinstance(self.base, MixtureSamples)  # data.mixing=online refuses synthetic data at load
        for name in self.weights:
            held = len(self.val.get(name, ()))
            if held < m:
                raise DataError(f"online mixing scores {m} held-out samples of {name!r} per update but its "
                                f"validation split holds {held}; raise data.val_fraction (now {self.cfg.val_fraction})"
                                f" or lower data.online.eval_samples")
        need = train_cfg.steps * train_cfg.global_batch_size
        if need > len(self.base):
            raise ConfigError(f"data.mixing=online places its phases in one pass of the mixture, but train.steps x "
                              f"global_batch_size = {need} samples exceed the pass of {len(self.base)}; set "
                              f"data.num_samples >= {need}")

    def _initial_weights(self) -> dict[str, float]:
        """data.weights of the mixed (positive-weight) sources, normalized."""
        total = sum(w for w in self.cfg.weights.values() if w > 0)
        return {n: w / total for n, w in sorted(self.cfg.weights.items()) if w > 0}

    def metrics(self) -> dict[str, float]:
        """The weights in force, for the train record of every step."""
        return {f"mix/{n}": w for n, w in self.weights.items()} if self.enabled else {}

    def held_out_losses(self, engine: Engine) -> dict[str, float]:
        """Mean loss of each mixed domain on its first eval_samples held-out samples (a global mean on every rank)."""
        m = self.online.eval_samples
        out = {}
        for name in self.weights:
            loader = BatchLoader(self.val[name], global_batch_size=m, micro_batch_size=self.micro,
                                 dp_rank=self.dp_rank, dp_size=self.dp_size)
            out[name] = engine.eval_loss(loader.batch_at(0))
        return out

    def after_step(self, step: int, engine: Engine, loader: Any) -> dict[str, Any] | None:
        """At every interval-th step: update the weights, start their phase at the loader's position, and return
        the `mixing` record; None otherwise."""
        if not self.enabled or step % self.online.interval:
            return None
        o = self.online
        update = doremi_update(self.weights, self.held_out_losses(engine), reference=o.reference,
                               step_size=o.step_size, smoothing=o.smoothing, round_to=o.round_to)
        start = int(loader.consumed_samples)
        self.phases.append((step, start, update.weights))
        self.weights = update.weights
        loader.samples = loader.samples.with_phases([(start, update.weights)])  # drops a batch read ahead
        log.info("mixing: step %d, from sample %d: %s", step, start,
                 "  ".join(f"{n} {w:.4f}" for n, w in self.weights.items()))
        return {"type": "mixing", "step": step, "start_sample": start,
                **{f"mix_loss/{n}": v for n, v in update.losses.items()},
                **{f"mix_excess/{n}": v for n, v in update.excess.items()}, **self.metrics()}

    def state_dict(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        return {"phases": [[step, start, dict(w)] for step, start, w in self.phases]}

    def load_state_dict(self, sd: dict[str, Any] | None, loader: Any) -> None:
        """Rebuild the mixture from the checkpoint's phases (the same list gives the same samples) and hand it to
        `loader`; a checkpoint without phases restarts from data.weights."""
        saved = (sd or {}).get("phases", [])
        phases = [(int(a), int(b), {str(k): float(v) for k, v in w.items()}) for a, b, w in saved]
        if not self.enabled:
            if phases:
                log.warning("the checkpoint holds %d online mixture phases; data.mixing=static ignores them and "
                            "trains on data.weights from here on", len(phases))
            return
        assert self.base is not None
        self.phases = phases
        self.weights = phases[-1][2] if phases else self._initial_weights()
        loader.samples = self.base.with_phases([(start, weights) for _, start, weights in phases])
