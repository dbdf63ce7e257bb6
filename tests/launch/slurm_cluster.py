"""A real SLURM cluster for tests: one controller and two emulated nodes (n1, n2) on this machine.

Facts this follows are in /work/shared/SLURM-CI.md (measured on the CI machine kind): Debian's slurm-wlm is built
with multiple-slurmd support, so each node is its own `slurmd -N nX` in private mount + UTS namespaces (the task's
`hostname` is the node name, /etc/hosts maps n1/n2 to 127.0.10.x). Everything lives under one temporary
directory: slurm.conf (never /etc/slurm), state, logs, spool, our own munged socket. Daemons run in the foreground
as our children and are stopped by the PIDs they wrote, never by name.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

APT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
NODES = {"n1": "127.0.10.1", "n2": "127.0.10.2"}
CPUS_PER_NODE = 8  # more than the machine has: SlurmdParameters=config_overrides lets nodes advertise it


REPO = Path(__file__).resolve().parents[2]


def job_env() -> dict[str, str]:
    """What a submitted job needs beyond SLURM_CONF: the repo importable from any submit directory."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}


class SlurmUnavailable(RuntimeError):
    """SLURM truly cannot run here (not root, no apt to install it); the reason is the message."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def ensure_installed() -> None:
    """apt-get install SLURM and munge when a binary is missing (12-23 s on the CI machine kind)."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("needs root: slurmd and munged run as root in private namespaces")
    if shutil.which("unshare") is None:
        raise SlurmUnavailable("needs util-linux `unshare` to give each emulated node its own hostname")
    if all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("SLURM is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-400:]}")


def _conf(d: Path, ctld_port: int, node_ports: dict[str, int]) -> str:
    host = socket.gethostname()
    lines = [
        "ClusterName=tessera-ci", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={ctld_port}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", f"AuthInfo=socket={d}/munge/sock",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={d}/jobcomp.txt", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides", "ReturnToService=2", "KillWait=5", "MpiDefault=none",
        "SchedulerType=sched/backfill", "SchedulerParameters=sched_interval=1", "MinJobAge=600",
        f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool-%n",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd-%n.log",
    ]
    for name, addr in NODES.items():
        lines.append(f"NodeName={name} NodeHostname={name} NodeAddr={addr} Port={node_ports[name]} "
                     f"CPUs={CPUS_PER_NODE} Sockets=1 CoresPerSocket={CPUS_PER_NODE} ThreadsPerCore=1 "
                     f"RealMemory=4000 State=UNKNOWN")
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


@dataclass
class SlurmCluster:
    """Controller + n1 + n2, all children of this process. Use `start()`, then `stop()` (also on failure)."""

    root: Path
    conf: Path = field(init=False)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.conf = self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment for sbatch/squeue/scontrol (and, through sbatch's --export=ALL, the jobs)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60.0) -> None:
        d = self.root
        # munged runs as user munge and checks every directory above its socket: keep the chain traversable.
        os.chmod(d, 0o755)
        for sub in ("state", "munge", "etc"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        shutil.chown(d / "munge", "munge", "munge")
        os.chmod(d / "munge", 0o711)  # munged: owner-only writes, execute for all
        hosts = Path("/etc/hosts").read_text() + "".join(f"{a} {n}\n" for n, a in NODES.items())
        (d / "etc" / "hosts").write_text(hosts)
        self.conf.write_text(_conf(d, _free_port(), {n: _free_port() for n in NODES}))
        self._spawn("munged", ["runuser", "-u", "munge", "--", "/usr/sbin/munged", "-F", f"--socket={d}/munge/sock",
                               f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/munge/munged.log",
                               f"--seed-file={d}/munge/seed"])
        self._wait_for(lambda: (d / "munge" / "sock").exists(), timeout, "munged socket")
        bind_hosts = f"mount --bind {d}/etc/hosts /etc/hosts"
        # -c: start from an empty state, whatever an earlier run of this directory left.
        self._spawn("slurmctld", ["unshare", "--mount", "--propagation", "private", "bash", "-ec",
                                  f'{bind_hosts}; exec slurmctld -D -c -f "{self.conf}"'])
        for name in NODES:
            self._spawn(name, ["unshare", "--mount", "--uts", "--propagation", "private", "bash", "-ec",
                               f'{bind_hosts}; hostname {name}; exec slurmd -D -f "{self.conf}" -N {name}'])
        self._wait_for(self._nodes_idle, timeout, "nodes n1, n2 idle")

    def _spawn(self, name: str, cmd: Sequence[str]) -> None:
        log = open(self.root / f"{name}.stderr", "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def _wait_for(self, ready: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n"
                                       + self.logs())
            if ready():  # type: ignore[operator]
                return
            time.sleep(0.2)
        raise TimeoutError(f"{what} not reached in {timeout} s:\n" + self.logs())

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> str:
        """Run a SLURM client command against this cluster and return its stdout."""
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, script: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit `script` from `cwd` (the job's SLURM_SUBMIT_DIR); returns the job id."""
        done = subprocess.run(["sbatch", "--parsable", *args, str(script)], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=30, cwd=cwd)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        """The job's state: from squeue while it is known there, else from the jobcomp file."""
        out = self.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T", check=False).strip()
        return out or self.final_state(job_id) or "UNKNOWN"

    def final_state(self, job_id: str) -> str | None:
        """The last state recorded in the jobcomp file (there is no sacct without slurmdbd)."""
        path = self.root / "jobcomp.txt"
        state = None
        for line in path.read_text().splitlines() if path.exists() else []:
            fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            if fields.get("JobId") == job_id:
                state = fields.get("JobState")
        return state

    def wait(self, job_id: str, until: Sequence[str], timeout: float = 120) -> str:
        """Poll every 0.5 s (sbatch --wait polls every 32 s) until the job's state is one of `until`."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in until:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {state} after {timeout} s (wanted {until}):\n" + self.logs())

    def restarts(self, job_id: str) -> int:
        """How often the job was requeued (`Restarts=` of `scontrol show job`)."""
        m = re.search(r"\bRestarts=(\d+)", self.run("scontrol", "show", "job", job_id, check=False))
        return int(m.group(1)) if m else 0

    def release_requeued(self, job_id: str, restarts: int = 1, timeout: float = 120) -> None:
        """Wait until the job is pending again after its `restarts`-th requeue, then start it now: SLURM holds a
        requeued job until BeginTime = now + 121 s, which a test does not need to sit through."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.job_state(job_id) == "PENDING" and self.restarts(job_id) >= restarts and not self._completing():
                # slurmd revokes the killed instance's credential with a 1 s timestamp; a new launch within that
                # second is refused ("already killed, do not launch batch job") and the job FAILS. Measured.
                time.sleep(2.0)
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
                return
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} not requeued ({self.job_state(job_id)}, restarts "
                           f"{self.restarts(job_id)}) after {timeout} s:\n" + self.logs())

    def _completing(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%t", check=False)
        return any(state.startswith("comp") for state in out.split())

    def logs(self, tail: int = 25) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.stderr")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, then TERM each daemon by its PID (nodes, controller, munged) and reap it."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "-u", "root", check=False)
            time.sleep(1.0)
        for name in [*NODES, "slurmctld", "munged"]:
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
