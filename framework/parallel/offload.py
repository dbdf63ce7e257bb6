"""NVMe offload of AdamW's states (ZeRO-Infinity, Rajbhandari et al. 2021): exp_avg and exp_avg_sq live in a file.

    opt = NVMeAdamW.wrap(build_optimizer(...), cfg.parallel.nvme_offload, device, tag="rank3")

Each rank keeps only the `step` counters in memory. Its local shards, laid end to end, are mirrored by a per-rank
file [exp_avg of every element | exp_avg_sq of every element]; a group is a range of about `group_mb` of state
over that concatenation (a large parameter spans several groups: AdamW is elementwise), read and written as two
contiguous pieces. `buffer_count` staging buffers bound the memory: while group i updates,
a reader thread fills the next free buffer with group i+1 (read-ahead) and a writer thread stores group i-1 and
then frees its buffer (write-behind); os.preadv/pwritev release the GIL, so the I/O runs beside the update.
Every group is updated by the same per-tensor, non-foreach AdamW kernel as `torch.optim.AdamW(foreach=False)`,
so an offloaded run is bitwise the in-memory one.

Checkpoints go through the ordinary DCP path: `state_dict()` returns the slots as tensors mapped from the file
(DTensors with the parameter's placements under FSDP), so DCP reads and reshards them like in-memory states and
saving costs no resident memory; loading writes the arriving states into the file.

Why not on top of `parallel.cpu_offload`: the two compose and neither needs the other. cpu_offload (FSDP2
`CPUOffloadPolicy`) moves parameters and gradients to host memory and runs the step there; NVMe offload moves
only the optimizer states, out of memory altogether, and streams them through pinned buffers to wherever the
parameters are (docs/PARALLELISM.md).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from framework.base.errors import CheckpointError, ConfigError
from framework.parallel.config import NVMeOffloadConfig

NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "glusterfs",
                       "fuse.glusterfs", "ceph", "fuse.ceph", "cephfs", "afs", "panfs", "wekafs", "9p",
                       "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "davfs", "orangefs", "pvfs2", "fuse.juicefs")
"""File systems that reach the state over a network: the step would wait on the fabric, not on a local drive."""

STATE_BYTES = 8
"""exp_avg + exp_avg_sq in fp32 per parameter element."""


def mount_of(path: Path, mounts_text: str | None = None) -> tuple[str, str]:
    """(mount point, file system type) holding `path`, from /proc/mounts (longest matching mount point)."""
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text()
        except OSError:
            return "/", "unknown"
    real = os.path.realpath(path)
    best = ("/", "unknown")
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fields[2])
    return best


def check_offload_path(path: str, need_bytes: int, mounts_text: str | None = None) -> None:
    """ConfigError naming `path` and the fix unless it is an existing, writable, local directory with `need_bytes`
    free."""
    key = "parallel.nvme_offload.path"
    p = Path(path)
    if not p.is_dir():
        what = "is not a directory" if p.exists() else "does not exist"
        raise ConfigError(f"{key}={path!r} {what}; create it on a local NVMe drive (mkdir -p {path}) or point "
                          f"{key} at one")
    point, fstype = mount_of(p, mounts_text)
    if fstype in NETWORK_FILESYSTEMS or fstype.startswith("nfs"):
        raise ConfigError(f"{key}={path!r} is on a network file system ({fstype} mounted at {point}): every step "
                          f"would stream the optimizer states over the network; use a node-local NVMe directory "
                          f"(e.g. /local_scratch or $TMPDIR on the compute node)")
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".tessera-probe-"):
            pass
    except OSError as err:
        raise ConfigError(f"{key}={path!r} is not writable by this user ({err.strerror}); fix its permissions or "
                          f"choose a directory you own") from err
    free = shutil.disk_usage(p).free
    if free < need_bytes:
        raise ConfigError(f"{key}={path!r} has {free / 2**30:.2f} GiB free but the optimizer states need "
                          f"{need_bytes / 2**30:.2f} GiB (8 bytes x the parameter elements of every rank on this "
                          f"host); free space there, point {key} at a larger drive, or shard over more ranks")


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray has the buffer protocol


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # FSDP2 updates the local shard in place too


def _grad_like_param(p: torch.Tensor) -> torch.Tensor:
    """p's gradient as the flat local piece matching p's local shard.

    A gradient may be placed unlike its parameter (TP's vocab-parallel embedding: a Shard(0) weight with a
    Replicate gradient); DTensor AdamW redistributes implicitly, so this does the same (Replicate -> Shard is a
    local slice, no communication).
    """
    g = p.grad
    assert g is not None
    if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return _local(g).reshape(-1)


@dataclass
class _Group:
    start: int  # first element of the group in the concatenated local shards
    numel: int  # parameter elements in the group (its state is twice that)
    pieces: list[tuple[torch.Tensor, int, int]]  # (parameter, first, last + 1 of its local elements here)


class NVMeAdamW(torch.optim.Optimizer):
    """AdamW whose exp_avg / exp_avg_sq are stored in a file on local NVMe and streamed through staging buffers."""

    def __init__(self, param_groups: Iterable[dict[str, Any]], defaults: dict[str, Any], cfg: NVMeOffloadConfig,
                 device: torch.device, tag: str) -> None:
        super().__init__(list(param_groups), dict(defaults))
        for g in self.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise ConfigError("parallel.nvme_offload supports plain AdamW (amsgrad=false, maximize=false)")
        self.cfg, self.device = cfg, device
        params = self._params()
        self.numel = sum(_local(p).numel() for p in params)
        self.dir = Path(tempfile.mkdtemp(prefix=f"tessera-optim-{tag}-", dir=cfg.path))
        self.file = self.dir / "adam_states.bin"
        with self.file.open("wb") as f:
            f.truncate(self.numel * STATE_BYTES)
        self._fd = os.open(self.file, os.O_RDWR)
        weakref.finalize(self, _remove, self._fd, self.dir)
        self._slot: dict[int, tuple[int, int]] = {}  # id(param) -> (first element, elements)
        start = 0
        for p in params:
            n = _local(p).numel()
            if n and not _local(p).is_contiguous():
                raise ConfigError("parallel.nvme_offload needs contiguous local parameter shards")
            self._slot[id(p)] = (start, n)
            start += n
        self.groups = self._plan_groups(params, max(1, int(cfg.group_mb * 2**20) // STATE_BYTES))
        for p in params:  # eager: DCP's state-dict helpers never see an empty state (no zero-lr warm-up step)
            self.state[p]["step"] = torch.tensor(0.0)
        biggest = 2 * max((g.numel for g in self.groups), default=0)
        pin = cfg.pin_memory and device.type != "cpu"
        self._buffers = [torch.empty(biggest, dtype=torch.float32, pin_memory=pin) for _ in range(cfg.buffer_count)]
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="nvme-offload") if cfg.overlap else None
        self.bytes_read = self.bytes_written = 0
        self.io_wait_s = 0.0  # time the step waited on I/O (reads not yet done, buffers not yet free)
        self._lock = threading.Lock()

    @classmethod
    def wrap(cls, opt: torch.optim.Optimizer, cfg: NVMeOffloadConfig, device: torch.device, tag: str) -> NVMeAdamW:
        """The offloaded twin of AdamW `opt` (same groups and hyper-parameters); `opt` must not have stepped."""
        if not isinstance(opt, torch.optim.AdamW):
            raise ConfigError(f"parallel.nvme_offload needs AdamW, got {type(opt).__name__}")
        if opt.state:
            raise ConfigError("parallel.nvme_offload: wrap the optimizer before its first step")
        groups = [{k: v for k, v in g.items()} for g in opt.param_groups]
        return cls(groups, opt.defaults, cfg, device, tag)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _plan_groups(self, params: list[torch.Tensor], group_numel: int) -> list[_Group]:
        """Cut the concatenated shards into ranges of `group_numel` elements, recording each parameter's pieces."""
        groups = [_Group(a, min(group_numel, self.numel - a), []) for a in range(0, self.numel, group_numel)]
        for p in params:
            first, n = self._slot[id(p)]
            for g in groups[first // group_numel:(first + n - 1) // group_numel + 1] if n else []:
                lo, hi = max(first, g.start) - first, min(first + n, g.start + g.numel) - first
                g.pieces.append((p, lo, hi))
        return groups

    # --- I/O ----------------------------------------------------------------------------------------------------
    def _io(self, op: Any, g: _Group, buf: torch.Tensor) -> None:
        """`op` (os.preadv / os.pwritev) over the group's exp_avg and exp_avg_sq ranges, resuming short transfers
        (Linux moves at most ~2 GiB per call)."""
        for k in range(2):  # exp_avg, then exp_avg_sq
            view, offset, done = _bytes(buf[k * g.numel:(k + 1) * g.numel]), (k * self.numel + g.start) * 4, 0
            while done < len(view):
                try:
                    n = op(self._fd, [view[done:]], offset + done)
                except OSError as err:  # ENOSPC, EIO: a typed error, one line, not a traceback
                    raise CheckpointError(f"the NVMe optimizer-state file {self.file}: {err.strerror} at byte "
                                          f"{offset + done}; free or replace the drive under parallel.nvme_offload"
                                          f".path, then rerun the same command: it resumes from the last "
                                          f"checkpoint") from err
                if n <= 0:
                    raise CheckpointError(f"the NVMe optimizer-state file {self.file} ends at byte {offset + done}, "
                                          f"before the {self.numel * STATE_BYTES} bytes it holds: it was truncated "
                                          f"(or the drive failed); rerun the same command: it resumes from the last "
                                          f"checkpoint and writes the file anew")
                done += n

    def _read(self, g: _Group, buf: torch.Tensor) -> torch.Tensor:
        self._io(os.preadv, g, buf)
        with self._lock:
            self.bytes_read += 2 * g.numel * 4
        return buf

    def _write(self, g: _Group, buf: torch.Tensor, free: deque[torch.Tensor] | None = None,
               freed: threading.Condition | None = None) -> None:
        try:
            self._io(os.pwritev, g, buf)
            with self._lock:
                self.bytes_written += 2 * g.numel * 4
        finally:  # a failed write (ENOSPC) still frees its buffer; step() re-raises it from the future
            if free is not None and freed is not None:
                with freed:
                    free.append(buf)
                    freed.notify()

    # --- the update ---------------------------------------------------------------------------------------------
    def _update(self, g: _Group, buf: torch.Tensor, hyper: dict[int, dict[str, Any]],
                steps: dict[int, torch.Tensor], grads: dict[int, torch.Tensor]) -> bool:
        """AdamW on the group's pieces with states in `buf`; False when no piece had a gradient.

        `steps` holds each parameter's step count before this step: every piece of a parameter is updated with
        that count + 1, which is stored once its last piece is done (AdamW counts steps per tensor).
        """
        devices = {_local(p).device for p, _, _ in g.pieces if id(p) in grads}
        if not devices:
            return False
        (to,) = devices
        on_host = to == buf.device
        # On an accelerator the group's states cross once each way (from pinned memory, asynchronously) and the
        # host waits once, before the write reads them: not a blocking copy per parameter piece.
        states = buf[:2 * g.numel] if on_host else buf[:2 * g.numel].to(to, non_blocking=True)
        for p, lo, hi in g.pieces:
            if id(p) not in grads:
                continue
            local, grad = _local(p).view(-1)[lo:hi], grads[id(p)][lo:hi]
            first = self._slot[id(p)][0] + lo - g.start
            m = states[first:first + hi - lo]
            v = states[g.numel + first:g.numel + first + hi - lo]
            h = hyper[id(p)]
            step = steps[id(p)].clone()
            adamw([local], [grad], [m], [v], [], [step], foreach=False, capturable=False,
                  differentiable=False, fused=False, grad_scale=None, found_inf=None, has_complex=False,
                  amsgrad=False, beta1=h["betas"][0], beta2=h["betas"][1], lr=h["lr"],
                  weight_decay=h["weight_decay"], eps=h["eps"], maximize=False)
            if hi == self._slot[id(p)][1]:
                self.state[p]["step"].copy_(step)
        if not on_host:
            buf[:2 * g.numel].copy_(states, non_blocking=True)
            torch.get_device_module(to).current_stream(to).synchronize()
        return True

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is None, "NVMeAdamW takes no closure"
        hyper = {id(p): g for g in self.param_groups for p in g["params"]}
        steps = {id(p): self.state[p]["step"].clone() for p in self._params()}
        grads = {id(p): _grad_like_param(p) for p in self._params() if p.grad is not None}
        if self._pool is None:
            for g in self.groups:
                buf = self._read(g, self._buffers[0])
                if self._update(g, buf, hyper, steps, grads):
                    self._write(g, buf)
            return
        self._pipelined(hyper, steps, grads)

    def _pipelined(self, hyper: dict[int, dict[str, Any]], steps: dict[int, torch.Tensor],
                   grads: dict[int, torch.Tensor]) -> None:
        assert self._pool is not None
        free: deque[torch.Tensor] = deque(self._buffers)
        freed = threading.Condition()
        reads: dict[int, Future[torch.Tensor]] = {}
        writes: list[Future[None]] = []
        n, issued = len(self.groups), 0
        for i, g in enumerate(self.groups):
            # read ahead into every free buffer; block for a buffer only when group i itself has none yet
            while issued < n:
                with freed:
                    if issued > i and not free:
                        break
                    t0 = time.perf_counter()
                    while not free:
                        freed.wait()
                    self.io_wait_s += time.perf_counter() - t0
                    buf = free.popleft()
                reads[issued] = self._pool.submit(self._read, self.groups[issued], buf)
                issued += 1
            t0 = time.perf_counter()
            buf = reads.pop(i).result()
            self.io_wait_s += time.perf_counter() - t0
            if self._update(g, buf, hyper, steps, grads):
                writes.append(self._pool.submit(self._write, g, buf, free, freed))
            else:
                with freed:
                    free.append(buf)
                    freed.notify()
        t0 = time.perf_counter()
        for w in writes:
            w.result()  # the states are on disk when step() returns (checkpoints read the file)
        self.io_wait_s += time.perf_counter() - t0

    def io_stats(self) -> dict[str, float]:
        return {"nvme_bytes_read": float(self.bytes_read), "nvme_bytes_written": float(self.bytes_written),
                "nvme_io_wait_s": self.io_wait_s}

    # --- checkpoints --------------------------------------------------------------------------------------------
    def _mapped(self) -> torch.Tensor:
        return torch.from_file(str(self.file), shared=True, size=self.numel * 2, dtype=torch.float32)

    def _as_state(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if isinstance(p, DTensor):
            return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return t

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state dict; exp_avg / exp_avg_sq are views of the file (writing them writes the file)."""
        sd = super().state_dict()
        if self.numel == 0:
            return sd
        mapped = self._mapped()
        for idx, p in enumerate(self._params()):
            if idx not in sd["state"]:
                continue
            start, n = self._slot[id(p)]
            shape = _local(p).shape
            entry = dict(sd["state"][idx])
            entry["exp_avg"] = self._as_state(p, mapped[start:start + n].view(shape))
            entry["exp_avg_sq"] = self._as_state(p, mapped[self.numel + start:self.numel + start + n].view(shape))
            sd["state"][idx] = entry
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Write the arriving exp_avg / exp_avg_sq into the file (unless DCP already loaded them into its views)."""
        params = self._params()
        # saved keys (indices, or FQNs from DCP) map to parameters by position in the groups, as in Optimizer
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        by_key = dict(zip(saved, params, strict=True))
        mapped = self._mapped() if self.numel else None
        kept: dict[Any, Any] = {}
        for idx, entry in state_dict["state"].items():
            entry = dict(entry)
            p = by_key[idx]
            start, n = self._slot[id(p)]
            for k, off in (("exp_avg", start), ("exp_avg_sq", self.numel + start)):
                value = entry.pop(k, None)
                if value is None or mapped is None:
                    continue
                src = _local(value).detach().reshape(-1)
                dst = mapped[off:off + n]
                if src.numel() != n:
                    raise ConfigError(f"optimizer state {k} of parameter {idx} has {src.numel()} elements here, "
                                      f"the layout needs {n}: load the checkpoint through DCP to reshard it")
                if src.device.type != "cpu" or src.data_ptr() != dst.data_ptr():
                    dst.copy_(src.to("cpu", torch.float32))
            kept[idx] = entry
        super().load_state_dict({"state": kept, "param_groups": state_dict["param_groups"]})
        for p in params:  # a parameter the checkpoint had no state for starts fresh, as in AdamW
            self.state[p].setdefault("step", torch.tensor(0.0))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _remove(fd: int, directory: Path) -> None:
    try:
        os.close(fd)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def offload_optimizers(optimizers: list[torch.optim.Optimizer], cfg: NVMeOffloadConfig, device: torch.device,
                       groups: Sequence[dist.ProcessGroup] = ()) -> list[torch.optim.Optimizer]:
    """`optimizers` with their states moved to `cfg.path` (unchanged when offload is off).

    Every rank checks the directory before any rank writes to it (so the free-space check sees the whole host's
    need: 8 bytes x local parameter elements x ranks on this host); the verdict is max-reduced over `groups`
    (the layout's mesh axes, which together reach every rank of it), so all ranks fail together instead of
    leaving the healthy ones waiting in a collective.
    """
    if not cfg.enabled:
        return optimizers
    rank = dist.get_rank() if dist.is_initialized() else 0
    numel = sum(_local(p).numel() for opt in optimizers for g in opt.param_groups for p in g["params"])
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    problem: ConfigError | None = None
    try:
        check_offload_path(cfg.path, STATE_BYTES * numel * per_host)
    except ConfigError as err:
        problem = err
    if groups:
        bad = torch.tensor([float(problem is not None)], device=device)
        for group in groups:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        if problem is None and bad.item() > 0:
            problem = ConfigError(f"parallel.nvme_offload.path={cfg.path!r} failed its check on another rank "
                                  f"of this layout; see that rank's error")
    if problem is not None:
        raise problem
    return [NVMeAdamW.wrap(opt, cfg, device, tag=f"rank{rank}-part{i}") for i, opt in enumerate(optimizers)]


def io_metrics(optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, float]:
    """Cumulative NVMe traffic of this rank's offloaded optimizers ({} when none is offloaded)."""
    out: dict[str, float] = {}
    for opt in optimizers:
        if isinstance(opt, NVMeAdamW):
            for k, v in opt.io_stats().items():
                out[k] = out.get(k, 0.0) + v
    return out
