"""Finding the processes of a running tritonserver, for tests that kill one of them."""

from __future__ import annotations

from pathlib import Path


def stub_pid(pgid: int, model: str) -> int:
    """The pid of the Python backend stub of `model` in process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(fields[2]) != pgid or fields[0] == "Z" or len(argv) < 2:
            continue
        if b"triton_python_backend_stub" in argv[0] and f"/{model}/".encode() in argv[1]:
            return int(stat.parent.name)
    raise LookupError(f"no stub of {model} in process group {pgid}")
