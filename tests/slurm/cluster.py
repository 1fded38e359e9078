"""A throwaway Slurm cluster for tests, of one node or of several: ``start``, ``stop``, ``status``.

Everything the cluster needs lives in one temporary directory: a private munged (own key and
socket), ``slurm.conf``, controller state, slurmd spools, logs and pid files. Clients reach it
through ``SLURM_CONF``, so nothing under ``/etc`` or ``/run/munge`` is touched, and ports are
picked free so it can coexist with a real Slurm or another test cluster.

One node (the default): slurmctld and slurmd run on this machine under its own hostname.

Several nodes (``--nodes N``): each node is a network namespace of its own (``/run/netns/<name>``)
with an address on a private bridge the cluster creates, and runs its own slurmd under its own
hostname (``node1`` ...) in a UTS and mount namespace of its own, where a private ``/etc/hosts``
(bind-mounted over the real one, which stays untouched) names every node. slurmctld runs in the
host namespace on the bridge address. The slurmd are started with ``nsenter --net=...`` followed
by ``unshare --uts --mount``; ``ip netns exec`` would remount ``/sys`` and slurmd would find no
cgroup filesystem. Jobs therefore see several hosts, each with its own hostname and address, and
reach each other over the bridge only; the filesystem is shared, as on a cluster with a shared
filesystem. The names of the bridge, veth pairs and namespaces carry a random tag and are
recorded in the cluster directory before they are created, so ``stop`` removes exactly those.

``stop`` cancels the cluster's jobs, stops every daemon it started by the pid in its pid file,
then (several nodes) ends any process still inside the cluster's namespaces by pid, removes the
namespaces, links and bridge, and removes the directory. The Debian packages ``slurm-wlm``,
``munge`` and ``iproute2`` are installed with apt-get when missing (that needs root, as do slurmd,
the private munged and the namespaces); they stay installed.

Command line (for running the Slurm tests' cluster by hand)::

    python -m tests.slurm.cluster start [--nodes N]  # prints the directory and the SLURM_CONF to export
    python -m tests.slurm.cluster status --root DIR
    python -m tests.slurm.cluster stop --root DIR
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge", "iproute2")
# Commands the cluster and its tests run; the daemons live in sbin, which a non-login PATH may lack.
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
# What several nodes need on top (nsenter and unshare come with util-linux, which Debian always has).
NETWORK_BINARIES = ("ip", "nsenter", "unshare")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
MUNGE_USER = "munge"
APT_TIMEOUT_S = 900
DAEMON_TIMEOUT_S = 30
NODE_IDLE_TIMEOUT_S = 60
JOBS_GONE_TIMEOUT_S = 60
NETNS_DIR = Path("/run/netns")
# Private subnets are drawn from 10.128.0.0/9 as /24s that no address or route of this machine overlaps.
SUBNET_POOL = ipaddress.ip_network("10.128.0.0/9")
NODE_HOST_OFFSET = 10  # node i gets <subnet>.(10 + i); the controller, on the bridge, gets <subnet>.1


class ClusterError(RuntimeError):
    """The cluster could not be started, or a command against it failed."""


def binary(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def missing_binaries() -> list[str]:
    return [name for name in (*BINARIES, *NETWORK_BINARIES) if binary(name) is None]


def apt_get(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)


def install_packages() -> str | None:
    """apt-get install the packages; return why that was impossible, or None on success."""
    if os.geteuid() != 0:
        return f"installing {', '.join(PACKAGES)} needs root"
    if binary("apt-get") is None:
        return f"there is no apt-get to install {', '.join(PACKAGES)} with"
    if apt_get("install", "-y", "-q", *PACKAGES).returncode == 0:
        return None
    # The package lists may be missing or stale on a fresh machine: refresh them once, retry.
    for step in (("update", "-q"), ("install", "-y", "-q", *PACKAGES)):
        done = apt_get(*step)
        if done.returncode != 0:
            return f"apt-get {step[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
    return None


def unavailable_reason() -> str | None:
    """Install Slurm when it is missing; return why a cluster (of any size) cannot run here, or None."""
    if os.geteuid() != 0:
        return "a test Slurm cluster needs root (slurmd starts jobs, munged runs as the munge user)"
    if missing_binaries():
        reason = install_packages()
        if reason is not None:
            return f"Slurm is not installed and could not be: {reason}"
    still_missing = missing_binaries()
    if still_missing:
        return f"binaries still missing after installing {PACKAGES}: {still_missing}"
    return network_unavailable_reason()


def network_unavailable_reason() -> str | None:
    """Why this machine cannot create the network namespaces of a multi-node cluster, or None."""
    probe = f"bdcp-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], env=tool_env(), capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces (`ip netns add` failed: {made.stderr.strip()})"
    subprocess.run(["ip", "netns", "delete", probe], env=tool_env(), capture_output=True, check=False)
    return None


def tool_env() -> dict[str, str]:
    return {**os.environ, "PATH": SEARCH_PATH}


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


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], env=tool_env(), capture_output=True, text=True, timeout=DAEMON_TIMEOUT_S)
    if check and done.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class Node:
    """One node of a multi-node cluster: its hostname (= NodeName), address, namespace and host-side veth."""

    name: str
    address: str
    netns: str
    veth: str


@dataclass(frozen=True)
class Network:
    """The private network of a multi-node cluster: a bridge (the controller's address) and the nodes on it."""

    bridge: str
    address: str
    prefix_len: int
    nodes: tuple[Node, ...]

    def links(self) -> list[str]:
        """Every link this network creates in the host namespace (the node ends live in the namespaces)."""
        return [self.bridge, *(node.veth for node in self.nodes)]

    def hosts_file(self, controller: str) -> str:
        """The ``/etc/hosts`` every node sees: localhost, the controller and every node, by name."""
        lines = ["127.0.0.1 localhost", f"{self.address} {controller}"]
        lines += [f"{node.address} {node.name}" for node in self.nodes]
        return "\n".join(lines) + "\n"


def used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine has an address in or a route to."""
    found = []
    for command in (("-4", "-o", "addr", "show"), ("-4", "route", "show", "table", "all")):
        for word in ip(*command).stdout.split():
            try:
                found.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    return [net for net in found if isinstance(net, ipaddress.IPv4Network)]


def link_names() -> set[str]:
    """Names of the links in the host namespace (``ip -o link`` prints ``N: name@peer: ...``)."""
    return {line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link", "show").stdout.splitlines()}


def plan_network(nodes: int) -> Network:
    """Names tagged at random, and a /24 that overlaps nothing this machine already uses."""
    used = used_networks()
    taken = link_names() | set(os.listdir(NETNS_DIR) if NETNS_DIR.is_dir() else [])
    subnets = list(SUBNET_POOL.subnets(new_prefix=24))
    for _ in range(100):
        tag = secrets.token_hex(2)
        subnet = subnets[secrets.randbelow(len(subnets))]
        names = [f"bdcp{tag}", *(f"bdcp{tag}v{i}" for i in range(1, nodes + 1))]
        clash = any(name.startswith((f"bdcp{tag}", f"bdcp-{tag}-")) for name in taken)
        if clash or any(subnet.overlaps(net) for net in used):
            continue
        base = subnet.network_address
        return Network(
            bridge=names[0],
            address=str(base + 1),
            prefix_len=subnet.prefixlen,
            nodes=tuple(
                Node(f"node{i}", str(base + NODE_HOST_OFFSET + i), f"bdcp-{tag}-node{i}", names[i])
                for i in range(1, nodes + 1)
            ),
        )
    raise ClusterError("found no free private /24 in 10.128.0.0/9 and no unused interface names")


def create_network(network: Network) -> None:
    """The bridge (controller address), then per node: namespace, veth pair, address, links up."""
    ip("link", "add", network.bridge, "type", "bridge")
    ip("addr", "add", f"{network.address}/{network.prefix_len}", "dev", network.bridge)
    ip("link", "set", network.bridge, "up")
    for node in network.nodes:
        inner = f"{node.veth}n"  # renamed eth0 inside the namespace
        ip("netns", "add", node.netns)
        ip("link", "add", node.veth, "type", "veth", "peer", "name", inner)
        ip("link", "set", inner, "netns", node.netns)
        ip("link", "set", node.veth, "master", network.bridge, "up")
        ip("-n", node.netns, "link", "set", inner, "name", "eth0")
        ip("-n", node.netns, "addr", "add", f"{node.address}/{network.prefix_len}", "dev", "eth0")
        ip("-n", node.netns, "link", "set", "eth0", "up")
        ip("-n", node.netns, "link", "set", "lo", "up")


def namespace_pids(netns: str) -> list[int]:
    """Live processes inside the network namespace ``/run/netns/<netns>`` (none when it is gone)."""
    try:
        inode = os.stat(NETNS_DIR / netns).st_ino
    except OSError:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if os.readlink(entry / "ns" / "net") == f"net:[{inode}]":
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def remove_network(network: Network) -> None:
    """End what still runs in the namespaces (by pid), then remove the namespaces, veth pairs and bridge."""
    for node in network.nodes:
        for pid in namespace_pids(node.netns):
            with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda node=node: not namespace_pids(node.netns), DAEMON_TIMEOUT_S, f"processes in {node.netns}")
        if (NETNS_DIR / node.netns).exists():
            ip("netns", "delete", node.netns)
    for link in set(network.links()) & link_names():  # a veth pair goes with its namespace end
        ip("link", "delete", link, check=False)
    left = sorted(set(network.links()) & link_names())
    if left:
        raise ClusterError(f"could not remove links {left}")


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

    @property
    def network_file(self) -> Path:
        return self.root / "network.json"

    @property
    def hosts_file(self) -> Path:
        return self.root / "hosts"

    def network(self) -> Network | None:
        """The multi-node network recorded at start (``None``: a single-node cluster)."""
        try:
            record = json.loads(self.network_file.read_text())
        except (OSError, ValueError):
            return None
        return Network(**{**record, "nodes": tuple(Node(**node) for node in record["nodes"])})

    def node_names(self) -> list[str]:
        network = self.network()
        return [node.name for node in network.nodes] if network else []

    def daemons(self) -> list[str]:
        """Daemon labels in start order: ``munged``, ``slurmctld``, then ``slurmd`` or ``slurmd@<node>`` per node."""
        names = self.node_names()
        return ["munged", "slurmctld", *([f"slurmd@{name}" for name in names] or ["slurmd"])]

    def pid_file(self, daemon: str) -> Path:
        if daemon == "munged":
            return self.munge_dir / "munged.pid"
        return self.root / f"{daemon.replace('@', '-')}.pid"  # slurmd@node1 -> slurmd-node1.pid (%n)

    def log_file(self, daemon: str) -> Path:
        if daemon == "munged":
            return self.munge_dir / "munged.log"
        return self.root / f"{daemon.replace('@', '-')}.log"

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
        return pid if process_alive(pid, daemon.split("@")[0]) else None

    def status(self) -> dict[str, int | None]:
        return {daemon: self.daemon_pid(daemon) for daemon in self.daemons()}

    def node_pids(self, node: str) -> list[int]:
        """Live processes on ``node`` of a multi-node cluster (inside its network namespace)."""
        network = self.network()
        netns = next((n.netns for n in network.nodes if n.name == node), None) if network else None
        if netns is None:
            raise ClusterError(f"{node!r} is not a node of the multi-node cluster at {self.root}")
        return namespace_pids(netns)

    def log_tails(self, lines: int = 15) -> str:
        tails = []
        for daemon in self.daemons():
            path = self.log_file(daemon)
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                tails.append(f"--- {path} ---\n" + "\n".join(tail))
        return "\n".join(tails)


def node_line() -> str:
    """This machine as Slurm sees it (``NodeName=... CPUs=... RealMemory=...``)."""
    described = subprocess.run([binary("slurmd") or "slurmd", "-C"], capture_output=True, text=True, check=True)
    return described.stdout.splitlines()[0].strip()


def node_lines(cluster: Cluster) -> tuple[str, list[str]]:
    """``(SlurmctldHost, node lines)``: this machine itself, or one line per namespace node (same resources)."""
    machine = node_line()
    name, resources = machine.split(maxsplit=1)
    network = cluster.network()
    if network is None:
        return name.removeprefix("NodeName="), [machine]
    controller = f"{socket.gethostname()}({network.address})"
    return controller, [f"NodeName={node.name} NodeAddr={node.address} {resources}" for node in network.nodes]


def slurm_conf(cluster: Cluster) -> str:
    controller, nodes = node_lines(cluster)
    several = cluster.network() is not None
    state = cluster.root / "state"
    # %n: the node's name, so every slurmd of a multi-node cluster has its own spool, pid file and log.
    per_node = "-%n" if several else ""
    controller_port, node_port = free_ports(2)
    settings = {
        "ClusterName": "blockdiag-cp-test",
        "SlurmctldHost": controller,
        "SlurmctldPort": controller_port,
        "SlurmdPort": node_port,
        "SlurmUser": "root",
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        # cred_expire also sets how long a requeued job waits before it may start again (120 s
        # by default); 10 s keeps the requeue test short and still outlasts a step launch here.
        "AuthInfo": f"socket={cluster.munge_dir / 'munge.socket'},cred_expire=10",
        "StateSaveLocation": state,
        "SlurmdSpoolDir": cluster.root / ("spool/%n" if several else "spool"),
        "SlurmctldPidFile": cluster.pid_file("slurmctld"),
        "SlurmdPidFile": cluster.root / f"slurmd{per_node}.pid",
        "SlurmctldLogFile": cluster.log_file("slurmctld"),
        "SlurmdLogFile": cluster.root / f"slurmd{per_node}.log",
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
    lines += [f"{node} State=UNKNOWN" for node in nodes]
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


def daemon_command(cluster: Cluster, daemon: str) -> list[str]:
    """How to start ``daemon``; a node's slurmd enters the node's network namespace and gets its own hostname.

    The mount namespace (``unshare --mount`` makes its mounts private) carries the node's
    ``/etc/hosts``; nothing in the host's mount table changes.
    """
    program, _, node = daemon.partition("@")
    path = binary(program) or program
    if not node:
        return [path]
    netns = next(n.netns for n in cluster.network().nodes if n.name == node)
    script = 'hostname "$1" && mount --bind "$2" /etc/hosts && exec "$3" -N "$1"'
    inner = ["sh", "-c", script, "node-slurmd", node, str(cluster.hosts_file), path]
    return ["nsenter", f"--net={NETNS_DIR / netns}", "--", "unshare", "--uts", "--mount", "--", *inner]


def start_slurm_daemon(cluster: Cluster, daemon: str) -> None:
    # Both daemonize: the command returns once the daemon has forked; its pid file follows.
    command = daemon_command(cluster, daemon)
    done = subprocess.run(command, env=cluster.env(), capture_output=True, text=True, timeout=DAEMON_TIMEOUT_S)
    if done.returncode != 0:
        raise ClusterError(f"{shlex.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    wait_for(lambda: cluster.daemon_pid(daemon) is not None, DAEMON_TIMEOUT_S, daemon)


def nodes_idle(cluster: Cluster, count: int) -> bool:
    states = cluster.run("sinfo", "--noheader", "--Node", "--format=%t", check=False).stdout.split()
    return states == ["idle"] * count


def start(root: Path, nodes: int = 1) -> Cluster:
    """Start munged, slurmctld and ``nodes`` slurmd under ``root`` (new or empty); wait until every node is idle."""
    if nodes < 1:
        raise ClusterError(f"nodes={nodes}: a cluster needs at least one node")
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)  # the munge user must reach its socket directory inside
    cluster = Cluster(root)
    try:
        (root / "state").mkdir()
        (root / "spool").mkdir()
        if nodes > 1:
            network = plan_network(nodes)
            # Recorded before anything exists, so that stop() removes whatever part was made.
            cluster.network_file.write_text(json.dumps(asdict(network), indent=1))
            for node in network.nodes:
                (root / "spool" / node.name).mkdir()
            cluster.hosts_file.write_text(network.hosts_file(socket.gethostname()))
            create_network(network)
        start_munged(cluster)
        cluster.conf.write_text(slurm_conf(cluster))
        for daemon in cluster.daemons()[1:]:
            start_slurm_daemon(cluster, daemon)
        wait_for(lambda: nodes_idle(cluster, nodes), NODE_IDLE_TIMEOUT_S, f"{nodes} node(s) to become idle")
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
    program = daemon.split("@")[0]
    os.kill(pid, signal.SIGTERM)
    try:
        wait_for(lambda: not process_alive(pid, program), DAEMON_TIMEOUT_S, f"{daemon} ({pid}) to exit")
    except ClusterError:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not process_alive(pid, program), DAEMON_TIMEOUT_S, f"{daemon} ({pid}) to die")


def stop(cluster: Cluster) -> None:
    """Stop what ``start`` started, by pid, remove the network (several nodes) and the cluster directory."""
    try:
        if cluster.daemon_pid("slurmctld") is not None:
            cancel_jobs(cluster)
    finally:
        try:
            for daemon in reversed(cluster.daemons()):
                stop_daemon(cluster, daemon)
        finally:
            network = cluster.network()
            try:
                if network is not None:
                    remove_network(network)
            finally:
                shutil.rmtree(cluster.root, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.slurm.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--root", type=Path, help="cluster directory (start: default a new temporary one)")
    parser.add_argument("--nodes", type=int, default=1, help="start: nodes, each in its own namespaces when > 1")
    args = parser.parse_args(argv)
    if args.action == "start":
        reason = unavailable_reason()
        if reason is not None:
            print(reason, file=sys.stderr)
            return 1
        root = args.root or Path(tempfile.mkdtemp(prefix="slurm-test-"))
        cluster = start(root, args.nodes)
        print(f"cluster directory: {cluster.root}\nexport SLURM_CONF={cluster.conf}")
        network = cluster.network()
        for node in network.nodes if network else ():
            print(f"node {node.name}: {node.address}, network namespace {NETNS_DIR / node.netns}")
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
