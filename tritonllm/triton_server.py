"""Start a real ``tritonserver`` on this project's model repository (`TritonServer`).

Where the binary comes from is `tritonllm.triton_install`; how its process group is started and
stopped is `tritonllm.processes`. The names of both modules that callers use (launch, tests,
benchmarks) are importable from here too. ``python -m tritonllm.triton_server --print-env``
prints the shell exports that run the same server by hand.

Locked down by default (README, "Security"): Triton's non-inference APIs (`RESTRICTED_APIS`:
shared memory, logging, trace, model repository, statistics, model config) answer only requests
that carry the server's admin key (`admin_headers`, generated per start), the generator takes
aborts only with the control secret (`control_secret`, generated per start, passed in the
environment, never on a command line), and the Python backend's shared memory lives in a
private, bounded /dev/shm (`processes.private_shm_command`).

Triton reads a model's instance count only from its config.pbtxt: `TritonServer`'s
``generator_instances`` > 1 serves a copy of the repository that differs in that count alone
(`repository_with_instances`).
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tritonllm.processes import (
    DEFAULT_BIND_ADDRESS,
    connect_host,
    free_port,
    private_shm_command,
    remove_shm_regions,
    restrict_shm_regions,
    start_process_group,
    stop_process_group,
    wait_http_ok,
)
from tritonllm.triton_install import TritonInstall, find_tritonserver, print_env, server_paths

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
GENERATOR_MODEL = "generator"

# Lines of a tritonserver log that say why something failed.
_ERROR_LINE = re.compile(r"error|exception|failed to load|traceback", re.IGNORECASE)

# Triton's APIs that no client of the service needs (the sidecar uses health, metadata and
# inference): open only to requests that carry the admin key. Shared memory would let a client
# map the Python backend's IPC regions (another request's data); logging and trace change the
# server; the model repository loads and unloads; statistics and model config tell what others
# run (request counts and timings, the model's path).
RESTRICTED_APIS = (
    "shared-memory",
    "logging",
    "trace",
    "model-repository",
    "statistics",
    "model-config",
)
# The HTTP header of the admin key; Triton's gRPC endpoint reads it from the metadata key
# "triton-grpc-protocol-" + this.
ADMIN_HEADER = "tritonllm-admin-key"
# Launcher settings from the environment: an operator's own admin key and control secret
# (otherwise both are generated per start).
ADMIN_KEY_ENV = "TRITONLLM_ADMIN_KEY"
CONTROL_SECRET_ENV = "TRITONLLM_CONTROL_SECRET"
# The OpenAI API's keys (the sidecar's, ``launch.API_KEY_ENV``): no model reads them.
API_KEY_ENV = "TRITONLLM_API_KEY"
# The Python backend's shared memory: each stub's region starts at 1 MiB and grows by 1 MiB
# steps (the backend's defaults: the regions of every test and benchmark workload stayed at
# 1 MiB; a prompt of a few MiB grows its stub's region to about three times its size, and a
# region never shrinks). The private /dev/shm bounds them all together: 256 MiB holds the
# largest requests the limits let through (README, "Security"); a request that needs more
# fails alone (Triton: "Failed to increase the shared memory pool size").
SHM_DEFAULT_BYTES = 1 << 20
SHM_GROWTH_BYTES = 1 << 20
SHM_LIMIT_BYTES = 256 << 20


def _setting_or_new(name: str) -> str:
    return os.environ.get(name, "").strip() or secrets.token_hex(32)


# In config.pbtxt (protobuf text format): where the instance groups start (``instance_group [``
# or ``instance_group {``), and an instance count.
_INSTANCE_GROUP = re.compile(r"\binstance_group\s*[\[{]")
_COUNT = re.compile(r"\bcount\s*:\s*\d+")
_COMMENT = re.compile(r"#[^\n]*")


def _with_instance_count(config: str, instances: int, where: Path) -> str:
    """``config`` (a config.pbtxt's text) with the one ``count: <n>`` of its instance_group set
    to ``instances``; the rest of the text as it was. Raises: RuntimeError (naming ``where``)
    unless the text has one instance_group holding one count."""
    # Comments blanked out, offsets kept: a commented-out group or count is not one.
    text = _COMMENT.sub(lambda m: " " * len(m.group()), config)
    groups = list(_INSTANCE_GROUP.finditer(text))
    counts = []
    if len(groups) == 1:
        depth, end = 0, len(text)
        for end in range(groups[0].end() - 1, len(text)):
            depth += (text[end] in "[{") - (text[end] in "]}")
            if depth == 0:
                break
        counts = list(_COUNT.finditer(text, groups[0].end(), end))
    if len(counts) != 1:
        raise RuntimeError(
            f"{where}: expected one instance_group with one 'count: <n>', found "
            f"{len(groups)} instance_group(s) and {len(counts)} count(s)"
        )
    start, stop = counts[0].span()
    return f"{config[:start]}count: {instances}{config[stop:]}"


def repository_with_instances(source: Path, model: str, instances: int, into: Path) -> Path:
    """A model repository, made in the existing directory ``into``, that serves ``source``
    with ``instances`` instances of ``model`` (Triton reads the count only from config.pbtxt).

    Made of symlinks: every model directory of ``source`` but ``model`` is a symlink to the
    original; ``model`` is a directory whose entries are symlinks to the original's, except
    its config.pbtxt, a copy with the instance_group's ``count`` set to ``instances``. A
    model.py reached through it resolves (``Path(__file__).resolve()``) into ``source``, where
    the project's models find the project root. Removing the copy leaves ``source`` as it was.

    Returns:
        the new repository, ``into / source.name``.

    Raises:
        ValueError: ``instances`` < 1.
        FileNotFoundError: ``source`` has no ``model/config.pbtxt``.
        RuntimeError: that config.pbtxt does not have exactly one ``count: <n>`` inside one
            instance_group.
        FileExistsError: ``into / source.name`` exists.
    """
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    source = Path(source).resolve()
    config_path = source / model / "config.pbtxt"
    config = _with_instance_count(config_path.read_text(), instances, config_path)
    target = Path(into) / source.name
    target.mkdir()
    for entry in sorted(source.iterdir()):
        if entry.is_dir() and entry.name != model:
            (target / entry.name).symlink_to(entry, target_is_directory=True)
    (target / model).mkdir()
    for entry in sorted((source / model).iterdir()):
        if entry.name != config_path.name:
            (target / model / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (target / model / config_path.name).write_text(config)
    return target


__all__ = [
    "DEFAULT_BIND_ADDRESS",
    "GENERATOR_MODEL",
    "MODEL_REPOSITORY",
    "REPO_ROOT",
    "TritonInstall",
    "TritonServer",
    "connect_host",
    "find_tritonserver",
    "free_port",
    "main",
    "print_env",
    "remove_shm_regions",
    "repository_with_instances",
    "server_paths",
    "start_process_group",
    "stop_process_group",
    "wait_http_ok",
]


@dataclass
class TritonServer:
    """A running tritonserver process on localhost ports; use as a context manager.

    Args:
        model_path: the Hugging Face model directory to serve (exported as ``TRITONLLM_MODEL``).
        model_repository: the Triton model repository (default: this project's).
        env: extra environment for the server and its Python stubs (e.g. engine settings).
        log_path: where the server's stdout/stderr go (default: a file in the temp dir).
        http_port, grpc_port, metrics_port: TCP ports (default: free ones).
        bind_address: the address all three endpoints listen on (tritonserver's own default is
            ``0.0.0.0``; this one is loopback only). ``0.0.0.0`` exposes them to the network.
        admin_key: the key of Triton's restricted APIs (`RESTRICTED_APIS`; default
            ``$TRITONLLM_ADMIN_KEY`` or a new random one). It is on tritonserver's command line,
            which other local users can read (README, "Security").
        control_secret: the secret the generator requires of aborts (default
            ``$TRITONLLM_CONTROL_SECRET`` or a new random one), passed to the server in its
            environment (``TRITONLLM_CONTROL_SECRET``); the sidecar needs the same.
        private_shm: run the server with a /dev/shm of its own (`SHM_LIMIT_BYTES`); None: where
            the host allows it, else its Python-backend regions are made 0600 once it is ready.
        generator_instances: instances of the ``generator`` model (its instance_group count);
            above 1, `start` serves a copy of ``model_repository`` with that count
            (`repository_with_instances`, in a temporary directory that `stop` removes).

    Raises:
        ValueError: ``generator_instances`` < 1.
    """

    model_path: Path | str | None = None
    model_repository: Path = MODEL_REPOSITORY
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    bind_address: str = DEFAULT_BIND_ADDRESS
    admin_key: str = field(default_factory=lambda: _setting_or_new(ADMIN_KEY_ENV), repr=False)
    control_secret: str = field(
        default_factory=lambda: _setting_or_new(CONTROL_SECRET_ENV), repr=False
    )
    private_shm: bool | None = None
    generator_instances: int = 1
    process: subprocess.Popen | None = None
    # The repository copy of `generator_instances` > 1 and its temporary directory, while
    # started.
    _repository_copy: Path | None = field(default=None, init=False, repr=False)
    _copy_dir: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.generator_instances < 1:
            raise ValueError(f"generator_instances must be >= 1, got {self.generator_instances}")

    @property
    def served_repository(self) -> Path:
        """The model repository tritonserver is given: ``model_repository``, or while started
        with ``generator_instances`` > 1, its copy with that many generator instances."""
        return self._repository_copy or Path(self.model_repository)

    @property
    def admin_headers(self) -> dict[str, str]:
        """The HTTP headers of a request to a restricted API (tritonclient's ``headers=``)."""
        return {ADMIN_HEADER: self.admin_key}

    @property
    def grpc_admin_headers(self) -> dict[str, str]:
        """The gRPC metadata of a request to a restricted API (tritonclient's ``headers=``)."""
        return {f"triton-grpc-protocol-{ADMIN_HEADER}": self.admin_key}

    @property
    def grpc_url(self) -> str:
        """``HOST:PORT`` of the gRPC endpoint, as a local client reaches it."""
        return f"{connect_host(self.bind_address)}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        """``HOST:PORT`` of the HTTP endpoint, as a local client reaches it."""
        return f"{connect_host(self.bind_address)}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        """The Prometheus metrics URL."""
        return f"http://{connect_host(self.bind_address)}:{self.metrics_port}/metrics"

    @property
    def shm_prefix(self) -> str:
        """The name prefix of this server's Python-backend shared-memory regions in /dev/shm
        (the backend's ``shm-region-prefix-name``; unique per launching process and HTTP
        port). `stop` removes what a killed stub or server left under it; with the backend's
        default prefix those regions (1 MB each at the default size) outlive the server and pile
        up (ARCHITECTURE.md, "Platform facts")."""
        return f"tritonllm_{os.getpid()}_{self.http_port}_"

    def command(self, install: TritonInstall) -> list[str]:
        """The ``tritonserver`` command line (HTTP, gRPC and metrics on ``bind_address``, metrics
        on, verbose logging off, `RESTRICTED_APIS` behind the admin key, the Python backend's
        shared memory sizes and region prefix)."""
        restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.admin_key}"
        shm = f"shm-default-byte-size={SHM_DEFAULT_BYTES},shm-growth-byte-size={SHM_GROWTH_BYTES}"
        return [
            str(install.binary),
            f"--model-repository={self.served_repository}",
            f"--backend-directory={install.backend_dir}",
            f"--http-address={self.bind_address}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.bind_address}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.bind_address}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--log-verbose=0",
            f"--http-restricted-api={restricted}",
            f"--grpc-restricted-protocol={restricted}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--backend-config=python,{shm}",
        ]

    def environment(self, install: TritonInstall) -> dict[str, str]:
        """This environment plus the interpreter's ``bin/`` first on PATH (see the module doc),
        the install's libraries on LD_LIBRARY_PATH, ``TRITONLLM_MODEL``, ``self.env`` and the
        control secret (``TRITONLLM_CONTROL_SECRET``, for the models); without the admin key
        and the OpenAI API keys, which the models never need (QA: ``make serve API_KEY=...``
        left the keys in every stub's environment)."""
        env = dict(os.environ)
        env.pop(ADMIN_KEY_ENV, None)
        env.pop(API_KEY_ENV, None)
        env.update(server_paths(install, env))
        if self.model_path is not None:
            env["TRITONLLM_MODEL"] = str(Path(self.model_path).resolve())
        env.update(self.env)
        env[CONTROL_SECRET_ENV] = self.control_secret
        return env

    def start(self, timeout: float = 180.0) -> TritonServer:
        """Start the server and wait until it reports ready (with ``generator_instances`` > 1,
        on a copy of the repository made first; `stop` removes it).

        Raises:
            RuntimeError: the process exited or was not ready within ``timeout`` seconds; the
                message carries the tail of the server log. Or the generator's config.pbtxt
                has no one instance count to set (`repository_with_instances`).
        """
        install = find_tritonserver()
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        if self.generator_instances > 1 and self._repository_copy is None:
            self._copy_dir = tempfile.TemporaryDirectory(prefix="tritonllm-repository-")
            try:
                self._repository_copy = repository_with_instances(
                    self.model_repository,
                    GENERATOR_MODEL,
                    self.generator_instances,
                    Path(self._copy_dir.name),
                )
            except BaseException:
                self._remove_repository_copy()
                raise
        command = self.command(install)
        private = None
        if self.private_shm is not False:
            private = private_shm_command(command, SHM_LIMIT_BYTES)
            if private is None and self.private_shm:
                raise RuntimeError("no private /dev/shm on this host (unshare --mount failed)")
        self.process = start_process_group(
            private or command, self.log_path, self.environment(install)
        )
        self.wait_ready(timeout)
        if private is None:
            restrict_shm_regions(self.shm_prefix)
        return self

    def wait_ready(self, timeout: float) -> None:
        """Wait until ``/v2/health/ready`` answers 200.

        Raises:
            RuntimeError: the process exited or was not ready within ``timeout`` seconds; the
                message carries the tail of the server log.
        """
        try:
            wait_http_ok(
                f"http://{self.http_url}/v2/health/ready", timeout, self.process, "tritonserver"
            )
        except RuntimeError as exc:
            errors = self.log_errors()
            details = "\n".join(errors) if errors else self.log_tail()
            raise RuntimeError(f"{exc} (log: {self.log_path}):\n{details}") from None

    def log_tail(self, n_chars: int = 6000) -> str:
        """The last ``n_chars`` characters of the server log ("" before there is one)."""
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        return Path(self.log_path).read_text(errors="replace")[-n_chars:]

    def log_errors(self, limit: int = 12, width: int = 600) -> list[str]:
        """The server log's last ``limit`` lines that report an error (a model that failed to
        load, an exception), each cut to ``width`` characters; [] without a log. Triton's
        model tables make a plain tail mostly padding, which can hide the reason."""
        if self.log_path is None or not Path(self.log_path).exists():
            return []
        lines = Path(self.log_path).read_text(errors="replace").splitlines()
        hits = [
            line.strip()[:width]
            for line in lines
            if _ERROR_LINE.search(line) and not line.lstrip().startswith("|")
        ]
        return hits[-limit:]

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL after ``timeout`` s), then
        remove the shared-memory regions left under its `shm_prefix` (none after a clean
        shutdown) and the repository copy of ``generator_instances`` > 1 (its symlinks only:
        the original repository stays)."""
        stop_process_group(self.process, timeout)
        if self.process is not None:
            remove_shm_regions(self.shm_prefix)
        self._remove_repository_copy()

    def _remove_repository_copy(self) -> None:
        if self._copy_dir is not None:
            self._copy_dir.cleanup()  # unlinks the symlinks, never follows them
        self._copy_dir = self._repository_copy = None

    def __enter__(self) -> TritonServer:
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tritonllm.triton_server --print-env``: print `print_env`'s export lines
    (``eval "$(...)"`` them in a shell). Returns the exit status."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--print-env",
        action="store_true",
        help="print shell exports to run this project's tritonserver by hand",
    )
    args = parser.parse_args(argv)
    if not args.print_env:
        parser.print_help()
        return 2
    try:
        sys.stdout.write(print_env())
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
