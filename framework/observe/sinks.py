"""Metric sinks behind the trainer's `MetricSink` protocol (`log(record)`, `close()`).

metrics.jsonl is always written by the trainer's `JsonlSink`; `build_sinks` adds the optional ones of
`cfg.observe` — wandb (offline unless asked otherwise) and TensorBoard. Only rank 0 builds sinks.

Records are the dicts of docs/METRICS.md. Train records go to wandb/TensorBoard as `train/<key>`; eval records
keep their `val_loss/<domain>` names; a `summary` record becomes the wandb run summary. wandb and TensorBoard are
imported only when enabled, so the training core runs where they are not installed.
"""

from __future__ import annotations

import math
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from framework.base.errors import ConfigError
from framework.observe.config import ObserveConfig, WandbConfig

_SKIP = {"type", "step"}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a record under their sink names (train/<key>, val_loss/<domain> ...)."""
    kind = record.get("type", "train")
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _SKIP or isinstance(value, str) or not isinstance(value, int | float):
            continue
        name = key if "/" in key or kind == "summary" else f"{kind}/{key}"
        out[name] = float(value)
    return out


class WandbSink:
    """Logs records to a wandb run stored under the run directory (offline by default).

    The wandb run id is kept in `<run dir>/wandb_run_id`, so a resumed training run continues the same wandb run.
    """

    def __init__(self, cfg: WandbConfig, run_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ConfigError("observe.wandb.enabled=true but wandb is not installed; pip install 'tessera[observe]' "
                              "or set observe.wandb.enabled=false") from err
        id_file = run_dir / "wandb_run_id"
        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:8]
            id_file.write_text(run_id + "\n")
        root = Path(cfg.dir) if cfg.dir else run_dir
        root.mkdir(parents=True, exist_ok=True)
        # Only what the user configured is passed; the API key stays where wandb finds it (env or netrc).
        settings = wandb.Settings(console="off", disable_git=True, save_code=False, silent=True,
                                  x_disable_stats=True, x_disable_machine_info=True)
        self.run = wandb.init(project=cfg.project or "tessera", entity=cfg.entity, group=cfg.group,
                              tags=list(cfg.tags) or None, name=run_name, id=run_id, resume="allow", dir=str(root),
                              mode=cfg.mode, config=config, settings=settings)

    def log(self, record: dict[str, Any]) -> None:
        if record.get("type") == "summary":
            self.run.summary.update(scalars(record))
            return
        data = scalars(record)
        if data:
            self.run.log(data, step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    """Scalars to `<run dir>/tensorboard` through torch's SummaryWriter."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError("observe.tensorboard=true needs the tensorboard package; pip install tensorboard or "
                              "set observe.tensorboard=false") from err
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        if record.get("type") == "summary":
            return
        for name, value in scalars(record).items():
            if math.isfinite(value):
                self.writer.add_scalar(name, value, global_step=int(record["step"]))

    def close(self) -> None:
        self.writer.close()


def build_sinks(cfg: ObserveConfig, run_dir: Path, run_name: str, config: dict[str, Any]) -> list[Any]:
    """The optional sinks `cfg` enables (metrics.jsonl is the trainer's own and always on)."""
    sinks: list[Any] = []
    if cfg.wandb.enabled and cfg.wandb.mode != "disabled":
        sinks.append(WandbSink(cfg.wandb, run_dir, run_name, config))
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir))
    return sinks


# --- reading wandb offline files back ----------------------------------------------------------------------
_BLOCK = 32768  # the .wandb transaction log is a LevelDB-style log: 32 KiB blocks of framed chunks
_FILE_HEADER = 7  # b":W&B" + magic 0xBEE1 + version byte


def _chunks(data: bytes) -> Iterator[bytes]:
    pos, pending = _FILE_HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):
            return  # a chunk still being written
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # full
            yield payload
        elif kind == 2:  # first
            pending = payload
        elif kind == 3:  # middle
            pending += payload
        elif kind == 4:  # last
            yield pending + payload
            pending = b""


def read_wandb_offline(path: str | Path, wait_s: float = 0.0) -> dict[str, Any]:
    """History, summary and config of an offline wandb run, decoded with wandb's own protobuf schema.

    Args:
        path: a `run-<id>.wandb` file, or a directory searched for one.
        wait_s: poll up to this long for the exit record before returning what is there.

    Returns:
        {"history": [{"_step": n, "train/loss": ...}, ...], "summary": {...}, "config": {...}, "run_id": str,
        "complete": bool} — complete once wandb wrote the run's exit record (its service may still be flushing
        right after `finish()` returns on a busy machine).
    """
    import time

    deadline = time.monotonic() + wait_s
    while True:
        out = _read_once(Path(path))
        if out["complete"] or time.monotonic() >= deadline:
            return out
        time.sleep(0.2)


def _read_once(path: Path) -> dict[str, Any]:
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    files = [path] if path.suffix == ".wandb" else sorted(path.rglob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file under {path}")
    out: dict[str, Any] = {"history": [], "summary": {}, "config": {}, "run_id": "", "complete": False}
    for file in files:
        for chunk in _chunks(file.read_bytes()):
            rec = pb.Record()  # type: ignore[attr-defined]
            rec.ParseFromString(chunk)
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                out["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in rec.history.item})
            elif kind == "summary":
                for item in rec.summary.update:
                    key = item.key or "/".join(item.nested_key)
                    if key:
                        out["summary"][key] = json.loads(item.value_json)
            elif kind == "exit":
                out["complete"] = True
            elif kind == "run":
                out["run_id"] = rec.run.run_id
                for item in rec.run.config.update:
                    out["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
