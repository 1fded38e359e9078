"""Build ``docker/Dockerfile`` with buildah on a local Debian base image, and run the result with podman.

The NGC base (``nvcr.io/nvidia/pytorch``) cannot be pulled here, so the build starts from a
stand-in made the same way an NGC release is laid out, from parts available here:

- Debian bookworm (``mmdebstrap --variant=minbase``: python3, python-is-python3), whose Python
  3.11 matches the tag of the CPU torch wheel (cp311);
- torch 2.13.0+cpu, and numpy and tqdm at pyproject.toml's pins (the Dockerfile leaves those
  three to the base), installed with pip into /usr/local like NGC's packages;
- NGC's pip settings: ``PIP_CONSTRAINT=/etc/pip/constraint.txt`` listing every package pip
  installed, and ``PIP_BREAK_SYSTEM_PACKAGES=1``.

Every wheel comes from one ``pip download`` on this machine into a wheel cache (the CPU torch
from the local wheel directory pip is configured with; never a CUDA build), and the Dockerfile's
pip installs read only that cache (a pip.conf mounted for the build: ``no-index``), so the build
needs no network and a second build downloads nothing. The base image is tagged with a hash of
its inputs and reused while they are unchanged.

Everything runs as root (rootful buildah and podman). The build's RUN steps use ``--isolation
chroot`` (no OCI runtime or cgroups needed); the image runs under ``runc`` with explicit
``--ulimit`` values, which this sandbox requires: see :data:`TOOLS` and :func:`ulimit_options`.

Command line (``--help`` for the options)::

    python -m tests.container.image base     # the local base image; prints its name
    python -m tests.container.image build    # base, then docker/Dockerfile on it; prints how to run it
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from tests.container.dockerfile import (
    DOCKERFILE,
    REPO,
    pyproject,
    recipe_requirements,
    recipe_requirements_left_to_the_base,
)

SUITE = "bookworm"  # Debian 12: Python 3.11, the tag (cp311) of the CPU torch wheel
PYTHON = (3, 11)
MIRROR = "http://deb.debian.org/debian"
DEB_PACKAGES = ("python3", "python-is-python3")  # NGC images answer to `python` too
# Documentation is of no use in a test image: dpkg leaves it out (licences stay).
DPKG_OPTIONS = (
    "force-unsafe-io",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
)
TORCH = "torch==2.13.0+cpu"  # the local version label: PyPI's 2.13.0 is a CUDA build
SITE_PACKAGES = "/usr/local/lib/python3.11/dist-packages"
BASE_REPOSITORY = "localhost/blockdiag-cp-base"
IMAGE = "localhost/blockdiag-cp:local"
# binary -> Debian package. crun refuses a cgroup v1/v2 hybrid whose v2 side has controllers
# ("cgroups in hybrid mode not supported"), as on these machines; runc runs there and anywhere else.
TOOLS = {"buildah": "buildah", "podman": "podman", "runc": "runc", "mmdebstrap": "mmdebstrap"}
RUN_OPTIONS = ("--runtime", "runc")  # podman's global options for every run
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "blockdiag-cp" / "container"
WHEELS_IN_BUILD = "/mnt"  # an empty directory in every Debian image: mounting there leaves nothing behind
OFFLINE_PIP_CONF = f"[global]\nno-index = true\nfind-links = {WHEELS_IN_BUILD}\n"
BASE_PIP_CONF = """\
# pip's site-wide configuration. Empty on purpose: like NGC's images, this base sets pip up through
# PIP_CONSTRAINT and PIP_BREAK_SYSTEM_PACKAGES. tests/container/image.py mounts its offline settings
# (the local wheel cache) over this file while it builds docker/Dockerfile.
"""
STEP_TIMEOUT_S = 1200
APT_TIMEOUT_S = 900
ULIMIT = 4096  # open files and processes per container: the recipe needs far fewer


class ImageError(RuntimeError):
    """A build or run step failed; the message holds the command and the end of its output."""


@dataclass
class Timings:
    """Wall seconds per build stage, in the order they ran."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - start

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.0f}s" for name, seconds in self.seconds.items())


def run(*command: str | Path, timeout_s: float = STEP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; a non-zero exit raises :class:`ImageError` with its output."""
    done = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()[-4000:]
        raise ImageError(f"{' '.join(map(str, command))} exited {done.returncode}:\n{output}")
    return done


def buildah(*args: str | Path, timeout_s: float = STEP_TIMEOUT_S) -> str:
    return run("buildah", *args, timeout_s=timeout_s).stdout.strip()


def image_exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name], capture_output=True, timeout=60).returncode == 0


# --------------------------------------------------------------------------------------------
# What this machine must offer
# --------------------------------------------------------------------------------------------


def missing_tools() -> list[str]:
    return [binary for binary in TOOLS if shutil.which(binary, path=SEARCH_PATH) is None]


def install_tools() -> str | None:
    """apt-get install the missing tools; return why that was impossible, or None on success."""
    packages = [TOOLS[binary] for binary in missing_tools()]
    if shutil.which("apt-get") is None:
        return f"there is no apt-get to install {packages} with"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ("install", "-y", "-q", "--no-install-recommends", *packages)

    def apt_get(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)

    if apt_get(*install).returncode == 0:
        return None
    # The package lists may be missing or stale on a fresh machine: refresh them once, retry.
    for step in (("update", "-q"), install):
        done = apt_get(*step)
        if done.returncode != 0:
            return f"apt-get {step[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
    return None


def namespaces_refused() -> str | None:
    """Why this kernel or sandbox refuses the namespaces every container needs, or None."""
    probe = ["unshare", "--mount", "--uts", "--ipc", "--net", "--pid", "--fork", "true"]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    if done.returncode == 0:
        return None
    return f"`{' '.join(probe)}` fails here ({done.stderr.strip()}): no container can start on this kernel/sandbox"


def setup_problem() -> str | None:
    """Install the tools when missing; return what stops building here (fixable setup), or None."""
    if sys.platform != "linux":
        return "buildah and podman need Linux"
    if os.geteuid() != 0:
        return "building and running the image needs root (rootful buildah and podman)"
    if sys.version_info[:2] != PYTHON:
        return (
            f"the local base's wheels are downloaded with this interpreter, so it must be Python "
            f"{PYTHON[0]}.{PYTHON[1]} like Debian {SUITE}'s (this is {sys.version.split()[0]})"
        )
    if missing_tools():
        reason = install_tools()
        if reason is not None:
            return f"{sorted(TOOLS)} are not installed and could not be: {reason}"
    return None


# --------------------------------------------------------------------------------------------
# Wheels, base image, image
# --------------------------------------------------------------------------------------------


def base_requirements() -> list[str]:
    """What pip installs into the base: torch and the recipe pins the Dockerfile leaves to the base."""
    return [TORCH, *(str(requirement) for requirement in recipe_requirements_left_to_the_base())]


class WheelDownload:
    """One ``pip download`` of everything the base and the Dockerfile install, running in the background.

    One resolution for both keeps them consistent; pip itself, the project's build backend
    (setuptools) and wheel (which this machine's pip needs to prepare an sdist offline) come
    along. A cache that already holds the set (a stamp in it names the requirements it was
    completed for) is used as it is; one holding part of it is completed, offline if it can be.
    """

    def __init__(self, wheels: Path) -> None:
        build_requires = pyproject()["build-system"]["requires"]
        recipe = [str(requirement) for requirement in recipe_requirements()]
        wanted = list(dict.fromkeys([*base_requirements(), *recipe, *build_requires, "pip", "wheel"]))
        wheels.mkdir(parents=True, exist_ok=True)
        self._stamp = wheels / ".complete"
        self._wanted = "\n".join(wanted) + "\n"
        self._output: str | None = None
        self._process: subprocess.Popen[str] | None = None
        if self._stamp.exists() and self._stamp.read_text() == self._wanted:
            return
        download = [sys.executable, "-m", "pip", "download", "-q", "--progress-bar", "off", "--dest", str(wheels)]
        offline = ["--no-index", "--find-links", str(wheels)]
        script = f"{shlex.join([*download, *offline, *wanted])} >/dev/null 2>&1 || {shlex.join([*download, *wanted])}"
        self._process = subprocess.Popen(
            ["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )

    def finish(self) -> None:
        """Wait for the download; raise :class:`ImageError` if it failed."""
        if self._process is None:
            return
        if self._output is None:
            self._output = self._process.communicate(timeout=STEP_TIMEOUT_S)[0]
        if self._process.returncode != 0:
            raise ImageError(f"pip download exited {self._process.returncode}:\n{self._output.strip()[-4000:]}")
        self._stamp.write_text(self._wanted)

    def cancel(self) -> None:
        """Stop the download if it still runs (its shell and pip: the session it was started in)."""
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()


def newest_pip_wheel(wheels: Path) -> Path:
    found = sorted(wheels.glob("pip-*-py3-none-any.whl"), key=lambda path: Version(path.name.split("-")[1]))
    if not found:
        raise ImageError(f"no pip wheel in {wheels}")
    return found[-1]


def base_tag() -> str:
    """The base's name: a hash of what makes it, so a changed input builds a new base, never a stale one."""
    makers = [inspect.getsource(function) for function in (make_base, install_into, configure_base)]
    inputs = [SUITE, MIRROR, *DEB_PACKAGES, *DPKG_OPTIONS, *base_requirements(), BASE_PIP_CONF, *makers]
    torch_version = TORCH.split("==")[1].replace("+", "-")
    digest = hashlib.sha256("\0".join(inputs).encode()).hexdigest()[:12]
    return f"{BASE_REPOSITORY}:{SUITE}-torch{torch_version}-{digest}"


def install_into(container: str, root: Path, wheels: Path) -> None:
    """pip-install the base's packages into the container's /usr/local; write NGC-style pip settings."""
    pip_wheel = newest_pip_wheel(wheels)
    mount = f"{wheels}:{WHEELS_IN_BUILD}:ro"
    pip = ["python3", f"{WHEELS_IN_BUILD}/{pip_wheel.name}/pip"]  # pip runs from its own wheel
    offline = ["--no-index", "--find-links", WHEELS_IN_BUILD, "--no-cache-dir", "--root-user-action=ignore"]
    install = [*pip, "install", *offline, "--break-system-packages", "pip", *base_requirements()]
    buildah("run", "--isolation=chroot", "-v", mount, container, *install)
    frozen = buildah(
        "run", "--isolation=chroot", container, "python", "-m", "pip", "freeze", "--all", "--path", SITE_PACKAGES
    )
    (root / "etc" / "pip").mkdir(exist_ok=True)
    (root / "etc" / "pip" / "constraint.txt").write_text(frozen + "\n")
    (root / "etc" / "pip.conf").write_text(BASE_PIP_CONF)


def build_base(wheels: Path, timings: Timings) -> str:
    """The local base image (built unless one from the same inputs exists) and the wheel cache; its name."""
    tag = base_tag()
    download = WheelDownload(wheels)  # overlaps with mmdebstrap: one waits on the network, the other on dpkg
    try:
        if not image_exists(tag):
            make_base(tag, wheels, download, timings)
            remove_other_bases(tag)
        with timings.stage("wheels"):
            download.finish()
    finally:
        download.cancel()
    return tag


def make_base(tag: str, wheels: Path, download: WheelDownload, timings: Timings) -> None:
    container = buildah("from", "scratch")
    try:
        root = Path(buildah("mount", container))
        with timings.stage("debian"):
            dpkg = [f"--dpkgopt={option}" for option in DPKG_OPTIONS]
            include = f"--include={','.join(DEB_PACKAGES)}"
            run("mmdebstrap", "--variant=minbase", "--mode=root", include, *dpkg, SUITE, root, MIRROR)
        with timings.stage("wheels"):
            download.finish()
        with timings.stage("base pip install"):
            install_into(container, root, wheels)
        configure_base(container)
        with timings.stage("base commit"):
            buildah("commit", "--quiet", container, tag)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, timeout=300)


def configure_base(container: str) -> None:
    environment = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "PIP_CONSTRAINT": "/etc/pip/constraint.txt",
        "PIP_BREAK_SYSTEM_PACKAGES": "1",
    }
    options = [option for name, value in environment.items() for option in ("--env", f"{name}={value}")]
    description = f"Debian {SUITE} + {', '.join(base_requirements())}: a local stand-in for NGC PyTorch"
    buildah(
        "config",
        *options,
        "--cmd",
        "/bin/bash",
        "--label",
        f"org.opencontainers.image.description={description}",
        container,
    )


def remove_other_bases(keep: str) -> None:
    """Drop bases built from older inputs: each holds a ~1.2 GB layer nobody will use again."""
    listed = run("podman", "images", "--format", "{{.Repository}}:{{.Tag}}", BASE_REPOSITORY).stdout.split()
    for name in listed:
        if name != keep:
            subprocess.run(["podman", "rmi", name], capture_output=True, timeout=300)


def build_image(base: str, tag: str, wheels: Path, timings: Timings) -> None:
    """``buildah build`` docker/Dockerfile on ``base`` with pip reading only the wheel cache."""
    pip_conf = wheels.parent / "pip-offline.conf"
    pip_conf.write_text(OFFLINE_PIP_CONF)
    if image_exists(tag):
        remove_image(tag)  # retagging would leave the old image behind, nameless, for good
    with timings.stage("dockerfile build"):
        mounts = ["-v", f"{wheels}:{WHEELS_IN_BUILD}:ro", "-v", f"{pip_conf}:/etc/pip.conf:ro"]
        arguments = ["--build-arg", f"BASE_IMAGE={base}", "-f", str(DOCKERFILE), "-t", tag]
        buildah("build", "--isolation=chroot", "--pull=never", *mounts, *arguments, REPO)


def build(tag: str = IMAGE, cache: Path = CACHE) -> Timings:
    """The base (reused when unchanged), then docker/Dockerfile on it, tagged ``tag``."""
    timings = Timings()
    wheels = cache / "wheels"
    base = build_base(wheels, timings)
    build_image(base, tag, wheels, timings)
    return timings


# --------------------------------------------------------------------------------------------
# Running the image
# --------------------------------------------------------------------------------------------


def ulimit_options() -> list[str]:
    """Explicit open-file and process limits: what the recipe needs, within the ones this process holds.

    podman gives a rootful container 1048576 of each by default, which only a process holding
    CAP_SYS_RESOURCE may raise to. A sandboxed root without it (as here: hard limits of 20000 open
    files, and podman lowers its own process limit to 32768) fails to start any container with
    "setrlimit `RLIMIT_NOFILE`: Operation not permitted" (or RLIMIT_NPROC).
    """
    options = []
    for name, limit in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        hard = resource.getrlimit(limit)[1]
        value = ULIMIT if hard == resource.RLIM_INFINITY else min(hard, ULIMIT)
        options += ["--ulimit", f"{name}={value}:{value}"]
    return options


def podman_run(
    image: str, *command: str, options: tuple[str, ...] = (), timeout_s: float = STEP_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """``podman run --rm`` with no network (nothing the image runs needs one); returns the completed run."""
    return subprocess.run(
        [
            "podman",
            *RUN_OPTIONS,
            "run",
            "--rm",
            "--pull=never",
            "--network=none",
            *ulimit_options(),
            *options,
            image,
            *command,
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@contextmanager
def mounted(image: str) -> Iterator[Path]:
    """The image's root filesystem, mounted read-only on this machine for the duration."""
    root = Path(run("podman", "image", "mount", image).stdout.strip())
    try:
        yield root
    finally:
        subprocess.run(["podman", "image", "unmount", image], capture_output=True, timeout=120)


def remove_image(image: str) -> None:
    """Remove a built image (its base stays)."""
    run("podman", "rmi", "--force", image, timeout_s=300)


def run_command(image: str) -> str:
    """How to run the recipe in the image by hand (what the tests run)."""
    podman = " ".join(["podman", *RUN_OPTIONS, "run", "--rm", "--network=none", *ulimit_options()])
    return f"{podman} {image} python recipes/finetune.py +cp=blockdiag trainer.max_steps=3"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.container.image", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("base", "build"), help="base: the local base image; build: base + Dockerfile")
    parser.add_argument("--tag", default=IMAGE, help=f"name of the built image (default {IMAGE})")
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"wheel cache (default {CACHE})")
    args = parser.parse_args(argv)
    problem = setup_problem() or namespaces_refused()
    if problem is not None:
        print(f"cannot build here: {problem}", file=sys.stderr)
        return 2
    timings = Timings()
    if args.what == "base":
        print(f"base image: {build_base(args.cache / 'wheels', timings)}")
    else:
        timings = build(args.tag, args.cache)
        print(f"image: {args.tag}\nrun it: {run_command(args.tag)}")
    print(f"took: {timings}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
