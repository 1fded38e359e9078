"""A throwaway single-node Slurm cluster for tests: ``start``, ``stop``, ``status``.

Everything the cluster needs lives in one temporary directory: a private munged (own key and
socket), ``slurm.conf``, controller state, slurmd spool, logs and pid files. Clients reach it
through ``SLURM_CONF``, so nothing under ``/etc`` or ``/run`` is touched, and ports are picked
free so it can coexist with a real Slurm. ``stop`` cancels the cluster's jobs, stops every
daemon it started by the pid in its pid file, and removes the directory. The Debian packages
``slurm-wlm`` and ``munge`` are installed with apt-get when missing (that needs root, as do
slurmd and the private munged); they stay installed.

Command line (for running the Slurm tests' cluster by hand)::

    python -m tests.slurm.cluster start              # prints the directory and the SLURM_CONF to export
    python -m tests.slurm.cluster status --root DIR
    python -m tests.slurm.cluster stop --root DIR
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
# Commands the cluster and its tests run; the daemons live in sbin, which a non-login PATH may lack.
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
DAEMONS = ("munged", "slurmctld", "slurmd")  # in start order; stopped in reverse
MUNGE_USER = "munge"
APT_TIMEOUT_S = 900
DAEMON_TIMEOUT_S = 30
NODE_IDLE_TIMEOUT_S = 60
JOBS_GONE_TIMEOUT_S = 60


class ClusterError(RuntimeError):
    """The cluster could not be started, or a command against it failed."""


def binary(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def missing_binaries() -> list[str]:
    return [name for name in BINARIES if binary(name) is None]


def apt_get(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)


def install_packages() -> str | None:
    """apt-get install the packages; return why that was impossible, or None on success."""
    if os.geteuid() != 0:
        return "installing slurm-wlm and munge needs root"
    if binary("apt-get") is None:
        return "there is no apt-get to install slurm-wlm and munge with"
    if apt_get("install", "-y", "-q", *PACKAGES).returncode == 0:
        return None
    # The package lists may be missing or stale on a fresh machine: refresh them once, retry.
    for step in (("update", "-q"), ("install", "-y", "-q", *PACKAGES)):
        done = apt_get(*step)
        if done.returncode != 0:
            return f"apt-get {step[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
    return None


def unavailable_reason() -> str | None:
    """Install Slurm when it is missing; return why a cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "a test Slurm cluster needs root (slurmd starts jobs, munged runs as the munge user)"
    if missing_binaries():
        reason = install_packages()
        if reason is not None:
            return f"Slurm is not installed and could not be: {reason}"
    still_missing = missing_binaries()
    if still_missing:
        return f"Slurm binaries still missing after installing {PACKAGES}: {still_missing}"
    return None


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)


def free_ports(count: int) -> list[int]:
    """Ports free right now; all probes stay bound until the end so the ports are distinct."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def process_alive(pid: int, name: str) -> bool:
    """True while ``pid`` is a live (not zombie) process running the binary ``name``."""
    path = binary(name)
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    # Checking the binary keeps a recycled pid from being mistaken for (and killed as) a daemon.
    # Debian's daemons are symlinks (slurmctld -> slurmctld-wlm), hence the realpath.
    return path is not None and exe == os.path.realpath(path) and state != "Z"


@dataclass(frozen=True)
class Cluster:
    """A cluster rooted at ``root``; every path below is inside it."""

    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    def pid_file(self, daemon: str) -> Path:
        return (self.munge_dir if daemon == "munged" else self.root) / f"{daemon}.pid"

    def log_file(self, daemon: str) -> Path:
        return (self.munge_dir if daemon == "munged" else self.root) / f"{daemon}.log"

    def env(self) -> dict[str, str]:
        """The environment for Slurm clients (and, through sbatch, for jobs) of this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": SEARCH_PATH}

    def run(self, *command: str, timeout_s: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(command, env=self.env(), capture_output=True, text=True, timeout=timeout_s)
        if check and done.returncode != 0:
            raise ClusterError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def daemon_pid(self, daemon: str) -> int | None:
        """The pid from the daemon's pid file when that process is still this daemon."""
        try:
            pid = int(self.pid_file(daemon).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if process_alive(pid, daemon) else None

    def status(self) -> dict[str, int | None]:
        return {daemon: self.daemon_pid(daemon) for daemon in DAEMONS}

    def log_tails(self, lines: int = 15) -> str:
        tails = []
        for daemon in DAEMONS:
            path = self.log_file(daemon)
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                tails.append(f"--- {path} ---\n" + "\n".join(tail))
        return "\n".join(tails)


def node_line() -> str:
    """This machine as Slurm sees it (``NodeName=... CPUs=... RealMemory=...``)."""
    described = subprocess.run([binary("slurmd") or "slurmd", "-C"], capture_output=True, text=True, check=True)
    return described.stdout.splitlines()[0].strip()


def slurm_conf(cluster: Cluster, node: str) -> str:
    node_name = node.split()[0].removeprefix("NodeName=")
    state = cluster.root / "state"
    spool = cluster.root / "spool"
    controller_port, node_port = free_ports(2)
    settings = {
        "ClusterName": "blockdiag-cp-test",
        "SlurmctldHost": node_name,
        "SlurmctldPort": controller_port,
        "SlurmdPort": node_port,
        "SlurmUser": "root",
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        # cred_expire also sets how long a requeued job waits before it may start again (120 s
        # by default); 10 s keeps the requeue test short and still outlasts a step launch here.
        "AuthInfo": f"socket={cluster.munge_dir / 'munge.socket'},cred_expire=10",
        "StateSaveLocation": state,
        "SlurmdSpoolDir": spool,
        "SlurmctldPidFile": cluster.pid_file("slurmctld"),
        "SlurmdPidFile": cluster.pid_file("slurmd"),
        "SlurmctldLogFile": cluster.log_file("slurmctld"),
        "SlurmdLogFile": cluster.log_file("slurmd"),
        # No cgroups or systemd here: plain process tracking and no task binding.
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_Core",
        "AccountingStorageType": "accounting_storage/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "JobCompType": "jobcomp/none",
        "MailProg": "/bin/true",
        "MpiDefault": "none",
        "ReturnToService": 2,
        "JobRequeue": 1,
        "KillWait": 5,
        # `sbatch --wait` polls every min(MinJobAge / 2, ...) seconds, growing fourfold otherwise;
        # 4 s keeps the poll at 2 s (and a finished job's record for 4 s, enough to be read).
        "MinJobAge": 4,
        # Start a requeued job as soon as its begin time passes, not at the next 60 s pass.
        "SchedulerParameters": "sched_interval=2",
    }
    lines = [f"{key}={value}" for key, value in settings.items()]
    lines.append(f"{node} State=UNKNOWN")
    lines.append("PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def start_munged(cluster: Cluster) -> None:
    """A private munged: own key, socket and pid file, run as the munge user it insists on."""
    munge = pwd.getpwnam(MUNGE_USER)
    cluster.munge_dir.mkdir(mode=0o755)
    os.chown(cluster.munge_dir, munge.pw_uid, munge.pw_gid)
    os.chmod(cluster.munge_dir, 0o755)  # munged requires its socket directory to be searchable by all
    key = cluster.munge_dir / "munge.key"
    with os.fdopen(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as sink:
        sink.write(os.urandom(1024))
    os.chown(key, munge.pw_uid, munge.pw_gid)
    command = [
        binary("munged") or "munged",
        f"--socket={cluster.munge_dir / 'munge.socket'}",
        f"--key-file={key}",
        f"--pid-file={cluster.pid_file('munged')}",
        f"--log-file={cluster.log_file('munged')}",
        f"--seed-file={cluster.munge_dir / 'munged.seed'}",
    ]
    subprocess.run(
        command, user=munge.pw_uid, group=munge.pw_gid, extra_groups=[], check=True, timeout=DAEMON_TIMEOUT_S
    )
    wait_for(lambda: cluster.daemon_pid("munged") is not None, DAEMON_TIMEOUT_S, "munged")


def start_slurm_daemon(cluster: Cluster, daemon: str) -> None:
    # Both daemonize: the command returns once the daemon has forked; its pid file follows.
    subprocess.run([binary(daemon) or daemon], env=cluster.env(), check=True, timeout=DAEMON_TIMEOUT_S)
    wait_for(lambda: cluster.daemon_pid(daemon) is not None, DAEMON_TIMEOUT_S, daemon)


def node_idle(cluster: Cluster) -> bool:
    states = cluster.run("sinfo", "--noheader", "--Node", "--format=%t", check=False).stdout.split()
    return states == ["idle"]


def start(root: Path) -> Cluster:
    """Start munged, slurmctld and slurmd under ``root`` (new or empty) and wait for an idle node."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)  # the munge user must reach its socket directory inside
    cluster = Cluster(root)
    try:
        for directory in ("state", "spool"):
            (root / directory).mkdir()
        start_munged(cluster)
        cluster.conf.write_text(slurm_conf(cluster, node_line()))
        for daemon in ("slurmctld", "slurmd"):
            start_slurm_daemon(cluster, daemon)
        wait_for(lambda: node_idle(cluster), NODE_IDLE_TIMEOUT_S, "the node to become idle")
    except (ClusterError, OSError, subprocess.SubprocessError) as err:
        logs = cluster.log_tails()
        stop(cluster)
        raise ClusterError(f"could not start the test Slurm cluster: {err}\n{logs}") from err
    return cluster


def cancel_jobs(cluster: Cluster) -> None:
    """Cancel every job of this (private) cluster and wait until they are gone."""
    jobs = cluster.run("squeue", "--noheader", "--format=%A", check=False).stdout.split()
    if not jobs:
        return
    cluster.run("scancel", *jobs, check=False)
    wait_for(
        lambda: not cluster.run("squeue", "--noheader", "--format=%A", check=False).stdout.split(),
        JOBS_GONE_TIMEOUT_S,
        f"jobs {jobs} to end",
    )


def stop_daemon(cluster: Cluster, daemon: str) -> None:
    pid = cluster.daemon_pid(daemon)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    try:
        wait_for(lambda: not process_alive(pid, daemon), DAEMON_TIMEOUT_S, f"{daemon} ({pid}) to exit")
    except ClusterError:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not process_alive(pid, daemon), DAEMON_TIMEOUT_S, f"{daemon} ({pid}) to die")


def stop(cluster: Cluster) -> None:
    """Stop what ``start`` started, by pid, and remove the cluster directory."""
    try:
        if cluster.daemon_pid("slurmctld") is not None:
            cancel_jobs(cluster)
    finally:
        for daemon in reversed(DAEMONS):
            stop_daemon(cluster, daemon)
        shutil.rmtree(cluster.root, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.slurm.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--root", type=Path, help="cluster directory (start: default a new temporary one)")
    args = parser.parse_args(argv)
    if args.action == "start":
        reason = unavailable_reason()
        if reason is not None:
            print(reason, file=sys.stderr)
            return 1
        root = args.root or Path(tempfile.mkdtemp(prefix="slurm-test-"))
        cluster = start(root)
        print(f"cluster directory: {cluster.root}\nexport SLURM_CONF={cluster.conf}")
        return 0
    if args.root is None:
        parser.error(f"{args.action} needs --root")
    cluster = Cluster(args.root)
    if args.action == "stop":
        stop(cluster)
        return 0
    for daemon, pid in cluster.status().items():
        print(f"{daemon}: {'running, pid ' + str(pid) if pid else 'not running'}")
    if cluster.daemon_pid("slurmctld") is not None:
        print(cluster.run("sinfo", check=False).stdout, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
