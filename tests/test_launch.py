"""``python -m tritonllm.launch`` (``make serve``): both servers come up, answer, and Ctrl-C stops
them with no process left behind."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import openai
import pytest

from tritonllm.launch import parse_args, resolve_model, served_name
from tritonllm.triton_server import (
    MODEL_REPOSITORY,
    TritonInstall,
    TritonServer,
    find_tritonserver,
    free_port,
    remove_shm_regions,
    repository_with_instances,
    start_process_group,
    stop_process_group,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
# Every process a test starts carries this variable (descendants inherit it), so the test can
# find them all, orphans included, whatever their process group or parent.
MARKER = "TRITONLLM_TEST_PROCESS_MARKER"


def _process_group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _marked_env() -> tuple[dict[str, str], str]:
    """This environment plus a fresh ``MARKER``; returns it and the ``NAME=VALUE`` entry."""
    value = uuid.uuid4().hex
    return dict(os.environ, **{MARKER: value}), f"{MARKER}={value}"


def _marked_processes(entry: str) -> dict[int, str]:
    """``{pid: command line}`` of the live (non-zombie) processes whose environment holds
    ``entry``."""
    found = {}
    needle = entry.encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle not in environ.read_bytes().split(b"\0"):
                continue
            state = (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
        if state != "Z":
            found[int(environ.parent.name)] = command
    return found


def _wait_none_marked(entry: str, timeout_s: float) -> dict[int, str]:
    """Poll until no process carries ``entry``; returns those still alive at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := _marked_processes(entry)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _kill_marked(entry: str) -> None:
    """Clean up after a failed test: SIGTERM a leftover launcher (it stops its servers), then
    SIGKILL whatever still carries ``entry``."""
    for pid, command in _marked_processes(entry).items():
        if "tritonllm.launch" in command:
            os.kill(pid, signal.SIGTERM)
    for pid in _wait_none_marked(entry, 40):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_none_marked(entry, 10)  # a SIGKILLed process lives on until the kernel has torn it down


def _listen_addresses(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp{,6}),
    IPv4-mapped IPv6 addresses as IPv4."""
    addresses = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            # gRPC listens on IPv4 through an IPv6 socket bound to ::ffff:A.B.C.D.
            addresses.add(socket.inet_ntop(family, raw).removeprefix("::ffff:"))
    return addresses


def _read_until(
    lines: queue.Queue[str], output: list[str], text: str | tuple[str, ...], timeout_s: float
) -> bool:
    """Collect output lines into ``output`` until one contains ``text`` (or one of the texts
    of a tuple); False on timeout."""
    texts = (text,) if isinstance(text, str) else text
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            output.append(lines.get(timeout=1))
        except queue.Empty:
            continue
        if any(t in output[-1] for t in texts):
            return True
    return False


def test_banner_names_the_triton_endpoints_beside_the_openai_base_url(monkeypatch):
    """QA: the launcher printed the OpenAI base URL only, so a Triton client of a service on
    other ports had to read the flags. The banner's next line names tritonserver's HTTP, gRPC
    and metrics endpoints on the ports given, a wildcard bind as the local address (as the
    base URL does)."""
    from tritonllm.launch import _banner

    monkeypatch.delenv("TRITONLLM_TRITON_HOST", raising=False)
    ports = ["--http-port=18000", "--grpc-port=18001", "--metrics-port=18002"]
    for host_args, host in (([], "127.0.0.1"), (["--triton-host=0.0.0.0"], "127.0.0.1")):
        lines = _banner(parse_args(ports + host_args), "m").splitlines()
        assert lines[0].startswith("OpenAI base URL: ")
        assert lines[1] == (
            f"Triton endpoints: HTTP http://{host}:18000, gRPC {host}:18001, "
            f"metrics http://{host}:18002/metrics"
        )
    lines = _banner(parse_args(["--triton-host=10.1.2.3"]), "m").splitlines()
    assert lines[1] == (
        "Triton endpoints: HTTP http://10.1.2.3:8000, gRPC 10.1.2.3:8001, "
        "metrics http://10.1.2.3:8002/metrics"
    )


def test_hub_ids_pass_through_and_dirs_resolve(tmp_path):
    assert resolve_model("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert served_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    model = tmp_path / "my-model"
    model.mkdir()
    assert resolve_model(str(model)) == str(model.resolve())
    assert served_name(resolve_model(str(model))) == "my-model"


def test_launch_serves_then_sigint_stops_everything(tiny_model_dir):
    port = free_port()
    triton_ports = {kind: free_port() for kind in ("grpc", "http", "metrics")}
    cmd = [sys.executable, "-m", "tritonllm.launch", f"--model={tiny_model_dir}", f"--port={port}"]
    cmd += [f"--{kind}-port={p}" for kind, p in triton_ports.items()]
    process = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True).start()
    output: list[str] = []
    try:
        deadline = time.monotonic() + 300
        # The banner ends with the Ctrl-C hint, after the URL and the curl example.
        while time.monotonic() < deadline and process.poll() is None:
            try:
                output.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            if "Ctrl-C" in output[-1]:
                break
        found = re.search(r"OpenAI base URL: (\S+)", "".join(output))
        base_url = found.group(1) if found else None
        assert base_url == f"http://127.0.0.1:{port}/v1", "".join(output)
        log = "".join(output)
        endpoints = (
            f"Triton endpoints: HTTP http://127.0.0.1:{triton_ports['http']}, gRPC "
            f"127.0.0.1:{triton_ports['grpc']}, metrics "
            f"http://127.0.0.1:{triton_ports['metrics']}/metrics\n"
        )
        assert endpoints in log, log
        triton_pid = int(re.search(r"tritonserver pid (\d+)", log).group(1))
        sidecar_pid = int(re.search(r"sidecar pid (\d+)", log).group(1))
        assert "curl " in log

        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        response = client.chat.completions.create(
            model=Path(tiny_model_dir).name,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
        )
        assert response.usage.completion_tokens == 4
        # Nothing is reachable from the network by default: the OpenAI API and tritonserver's
        # HTTP, gRPC and metrics endpoints all listen on loopback only.
        for name, p in {"sidecar": port, **triton_ports}.items():
            assert _listen_addresses(p) == {"127.0.0.1"}, name

        # Streams in flight at shutdown are aborted, not waited for: they end with
        # finish_reason "abort" and the whole stop takes seconds (it took ~36 s, ending in
        # SIGKILLs, when the sidecar waited for them).
        first_chunk, ends = threading.Barrier(4), queue.Queue()

        def stream_until_stopped():
            stream = client.chat.completions.create(
                model=Path(tiny_model_dir).name,
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=1900,
                stream=True,
            )
            finish, started = None, False
            try:
                for chunk in stream:
                    if not started:
                        started = True
                        first_chunk.wait(60)
                    finish = chunk.choices[0].finish_reason if chunk.choices else finish
                ends.put(finish)
            except Exception as exc:  # noqa: BLE001 (reported to the test thread)
                ends.put(exc)

        for _ in range(3):
            threading.Thread(target=stream_until_stopped, daemon=True).start()
        first_chunk.wait(60)
        stop = time.monotonic()
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
        assert time.monotonic() - stop < 12.0
        assert [ends.get(timeout=10) for _ in range(3)] == ["abort"] * 3
        assert not _alive(triton_pid) and not _alive(sidecar_pid)
        # tritonserver's Python backend stubs live in its process group: none may survive.
        assert _process_group_members(triton_pid) == []
        assert _process_group_members(sidecar_pid) == []
    finally:
        # On a failure above, still let the launcher stop its children (SIGKILL would orphan them).
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_bind_addresses_default_to_loopback_and_can_be_changed(monkeypatch):
    install = TritonInstall(Path("tritonserver"), Path("backends"))
    flags = ("--http-address", "--grpc-address", "--metrics-address")

    def addresses(server: TritonServer) -> dict[str, str]:
        command = server.command(install)
        return {f: a.split("=", 1)[1] for a in command for f in flags if a.startswith(f + "=")}

    assert addresses(TritonServer()) == dict.fromkeys(flags, "127.0.0.1")
    exposed = TritonServer(bind_address="0.0.0.0")
    assert addresses(exposed) == dict.fromkeys(flags, "0.0.0.0")
    assert exposed.grpc_url == f"127.0.0.1:{exposed.grpc_port}"  # a wildcard is reached locally
    assert TritonServer(bind_address="::1").http_url.startswith("[::1]:")

    monkeypatch.delenv("TRITONLLM_HOST", raising=False)
    monkeypatch.delenv("TRITONLLM_TRITON_HOST", raising=False)
    cfg = parse_args([])
    assert (cfg.host, cfg.triton_host) == ("127.0.0.1", "127.0.0.1")
    cfg = parse_args(["--host=0.0.0.0", "--triton-host=10.1.2.3"])
    assert (cfg.host, cfg.triton_host) == ("0.0.0.0", "10.1.2.3")
    assert cfg.base_url == "http://127.0.0.1:9000/v1"
    monkeypatch.setenv("TRITONLLM_HOST", "0.0.0.0")
    monkeypatch.setenv("TRITONLLM_TRITON_HOST", "0.0.0.0")
    assert (parse_args([]).host, parse_args([]).triton_host) == ("0.0.0.0", "0.0.0.0")


def test_tritonserver_has_the_bind_address_flags():
    """The real tritonserver (2.51) documents the three address flags ``command`` passes."""
    server = TritonServer()
    install = find_tritonserver()
    result = subprocess.run(
        [str(install.binary), "--help"],
        env=server.environment(install),
        capture_output=True,
        text=True,
        timeout=60,
    )
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert flag in result.stdout + result.stderr, flag


def test_each_server_keeps_its_shared_memory_under_its_own_prefix(tmp_path):
    """The Python backend names its regions after the server's prefix, so stopping one server
    can remove what its killed stubs left without touching another server's regions."""
    a, b = TritonServer(), TritonServer()
    assert a.shm_prefix != b.shm_prefix and not b.shm_prefix.startswith(a.shm_prefix)
    flag = f"--backend-config=python,shm-region-prefix-name={a.shm_prefix}"
    assert flag in a.command(TritonInstall(Path("tritonserver"), Path("backends")))
    for name in (f"{a.shm_prefix}1", f"{a.shm_prefix}stub_2", f"{b.shm_prefix}1", "other"):
        (tmp_path / name).write_bytes(b"x")
    assert sorted(remove_shm_regions(a.shm_prefix, tmp_path)) == [
        f"{a.shm_prefix}1",
        f"{a.shm_prefix}stub_2",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{b.shm_prefix}1", "other"])
    assert remove_shm_regions(a.shm_prefix, tmp_path / "missing") == []


def test_stop_process_group_kills_members_left_by_a_dead_leader():
    """The group leader exits at once; its child ignores SIGTERM, as Triton's Python backend stubs
    do once their server is gone. Stopping the group must still end the child."""
    env, entry = _marked_env()
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    leader = (
        "import subprocess, sys; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}]); print('started', flush=True)"
    )
    process = start_process_group([sys.executable, "-c", leader], env=env)
    try:
        assert process.wait(30) == 0
        assert len(_wait_none_marked(entry, 0)) == 1  # the orphaned child, still running
        started = time.monotonic()
        stop_process_group(process, timeout_s=1.0)
        assert _marked_processes(entry) == {}
        assert time.monotonic() - started < 10
    finally:
        _kill_marked(entry)


def test_failed_tritonserver_start_leaves_no_process(tiny_model_dir):
    """tritonserver exits when its gRPC port is taken, after the Python backend stubs started;
    the launcher reports the failure and no stub survives."""
    env, entry = _marked_env()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cmd = [
            sys.executable,
            "-m",
            "tritonllm.launch",
            f"--model={tiny_model_dir}",
            f"--port={free_port()}",
            f"--grpc-port={busy.getsockname()[1]}",
            f"--http-port={free_port()}",
            f"--metrics-port={free_port()}",
        ]
        process = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            output, _ = process.communicate(timeout=300)
            assert process.returncode == 1, output
            assert "launch failed" in output
            assert _wait_none_marked(entry, 5) == {}
        finally:
            if process.poll() is None:
                process.kill()
            _kill_marked(entry)


def test_failed_model_load_reports_the_reason_and_the_log(tiny_model_dir):
    """A model that fails to load (a bad setting) makes the launcher print the reason from the
    tritonserver log (not only a tail of model tables) and where the log is."""
    env, entry = _marked_env()
    env["TRITONLLM_ENGINE_PROCESS"] = "maybe"
    cmd = [sys.executable, "-m", "tritonllm.launch", f"--model={tiny_model_dir}"]
    cmd += [f"--{kind}-port={free_port()}" for kind in ("grpc", "http", "metrics")]
    process = subprocess.Popen(
        cmd + [f"--port={free_port()}"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 1, output
        assert "launch failed" in output
        assert "TRITONLLM_ENGINE_PROCESS" in output and "'maybe'" in output, output
        log = re.search(r"\(log: (\S+)\)", output)
        assert log and Path(log.group(1)).is_file(), output
        assert _wait_none_marked(entry, 5) == {}
    finally:
        if process.poll() is None:
            process.kill()
        _kill_marked(entry)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_sigterm_to_make_serve_stops_everything(tiny_model_dir):
    """``kill <make's pid>`` (what ``timeout make serve`` and supervisors do) stops the launcher,
    tritonserver with its stubs and the sidecar: make forwards SIGTERM only to its own child.
    With ``API_KEY=...`` the startup hint's curl command, pasted into a shell after the
    ``export`` it asks for, gets its completion (it got a 401: the key was not in that shell)."""
    env, entry = _marked_env()
    env.pop("TRITONLLM_API_KEY", None)
    venv = os.path.relpath(sys.prefix, REPO_ROOT)
    ports = f"--port={free_port()}" + "".join(
        f" --{kind}-port={free_port()}" for kind in ("grpc", "http", "metrics")
    )
    cmd = ["make", "--no-print-directory", "serve", f"VENV={venv}", f"MODEL={tiny_model_dir}"]
    # -o: the virtualenv is the one running this test; never reinstall it from here.
    cmd += ["-o", f"{venv}/.installed", f"SERVE_ARGS={ports}", "API_KEY=k-make-one,k-make-two"]
    make = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the signal goes to make alone, as from a supervisor
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in make.stdout], daemon=True).start()
    output: list[str] = []
    try:
        assert _read_until(lines, output, "Ctrl-C", 300), "".join(output)
        banner = "".join(output)
        assert "k-make-one" not in banner  # make's echo of its recipe included it
        assert "`export TRITONLLM_API_KEY=<your API key>`" in banner
        hint = re.search(r"^try: (curl .*)$", banner, re.MULTILINE)[1]
        pasted = subprocess.run(
            ["bash", "-c", f"export TRITONLLM_API_KEY=k-make-one,k-make-two; {hint}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert '"object":"chat.completion"' in pasted.stdout, pasted
        assert len(_marked_processes(entry)) >= 3  # make, launcher, servers (and stubs)
        make.send_signal(signal.SIGTERM)
        make.wait(60)
        left = _wait_none_marked(entry, 60)
        assert left == {}, left
    finally:
        if make.poll() is None:
            make.kill()
            make.wait()
        _kill_marked(entry)


def test_make_serve_hands_the_api_key_to_the_launcher_without_printing_it(tmp_path):
    """QA: ``make serve API_KEY=...`` printed the key, in the recipe line make echoes. The key
    still reaches the launcher's environment (``TRITONLLM_API_KEY``, with
    ``TRITONLLM_API_KEY_FROM_MAKE``), and the echoed line (without it) is still printed; a key
    exported in the shell instead passes through as it is. A stand-in for the launcher reports
    what it got (make's ``PY``)."""
    key = "k-make-secret-1,k-make-secret-2"
    launcher = tmp_path / "launcher"
    launcher.write_text(
        "#!/bin/sh\n"
        f'[ "$TRITONLLM_API_KEY" = "{key}" ] && echo "launcher: the key" || echo "launcher: no key"\n'
        'echo "launcher: from make=${TRITONLLM_API_KEY_FROM_MAKE-unset} args=$*"\n'
    )
    launcher.chmod(0o755)
    venv = os.path.relpath(sys.prefix, REPO_ROOT)
    make = ["make", "--no-print-directory", "serve", f"VENV={venv}", "-o", f"{venv}/.installed"]
    make += [f"PY={launcher}", "SERVE_ARGS=--port 9999"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITONLLM_API_KEY")}
    cases = [
        ([f"API_KEY={key}"], env, "from make=1"),
        ([], {**env, "TRITONLLM_API_KEY": key}, "from make=unset"),
    ]
    for extra, environment, origin in cases:
        run = subprocess.run(
            make + extra, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=60
        )
        output = run.stdout + run.stderr
        assert run.returncode == 0, output
        assert "k-make-secret" not in output, output
        assert "launcher: the key" in output and origin in output, output
        assert f"exec {launcher} -m tritonllm.launch" in output  # make's echo of the recipe
        assert "args=-m tritonllm.launch --port 9999" in output, output


def test_readme_plain_tritonserver_recipe_serves(tiny_model_dir, tmp_path):
    """README's plain-tritonserver recipe: `eval "$(python -m tritonllm.triton_server
    --print-env)"`, then the bare binary with `--backend-directory "$TRITON_BACKEND_DIR"`, from
    a shell whose PATH lacks the virtualenv and which has no LD_LIBRARY_PATH, serves the
    ensemble (a found QA: without the exported library path the stubs could not load
    libcudart/libpython and the server hung)."""
    import json
    import urllib.request

    from tritonllm.triton_server import wait_http_ok

    env, entry = _marked_env()
    env["PATH"] = "/usr/bin:/bin"
    env.pop("LD_LIBRARY_PATH", None)
    env["TRITONLLM_MODEL"] = str(tiny_model_dir)
    http, grpc, metrics = free_port(), free_port(), free_port()
    script = (
        f'eval "$({sys.executable} -m tritonllm.triton_server --print-env)" && exec '
        '"$TRITONSERVER" --model-repository model_repository '
        '--backend-directory "$TRITON_BACKEND_DIR" --http-address 127.0.0.1 '
        f"--grpc-address 127.0.0.1 --metrics-address 127.0.0.1 --http-port {http} "
        f"--grpc-port {grpc} --metrics-port {metrics}"
    )
    log = tmp_path / "server.log"
    process = start_process_group(["bash", "-c", script], log, env, REPO_ROOT)
    try:
        try:
            wait_http_ok(f"http://127.0.0.1:{http}/v2/health/ready", 240, process, "tritonserver")
        except RuntimeError as exc:
            raise AssertionError(f"{exc}\n{log.read_text()[-3000:]}") from None
        body = json.dumps({"text_input": "Hello", "max_tokens": 4, "stream": False}).encode()
        url = f"http://127.0.0.1:{http}/v2/models/llm/generate"
        with urllib.request.urlopen(urllib.request.Request(url, body), timeout=60) as response:
            reply = json.loads(response.read())
        assert isinstance(reply["text_output"], str) and reply["text_output"]
    finally:
        stop_process_group(process, 30)
        _kill_marked(entry)


def test_tensor_parallel_flag_reaches_the_servers_environment(tmp_path):
    """``--tensor-parallel-size 2`` becomes ``TRITONLLM_TENSOR_PARALLEL_SIZE=2`` in the
    environment of every tritonserver the supervisor starts, restarts included (what the
    generator reads); without it, nothing is set."""
    from tritonllm.launch import build_supervisor

    model = str(tmp_path)
    with_tp = build_supervisor(parse_args(["--tensor-parallel-size", "2"]), model, "m")
    without = build_supervisor(parse_args([]), model, "m")
    first, restart = with_tp.new_triton(), with_tp.new_triton()
    tp = {"TRITONLLM_MODEL": model, "TRITONLLM_TENSOR_PARALLEL_SIZE": "2"}
    assert first.env == restart.env == tp
    assert without.new_triton().env == {"TRITONLLM_MODEL": model}


def test_sidecar_workers_flag_reaches_the_sidecar_command_line(tmp_path):
    """``--sidecar-workers 3`` runs the sidecar with ``--workers=3``; without it the sidecar's
    command line is what it was (one process); below 1 is a usage error."""
    from tritonllm.launch import build_supervisor

    model = str(tmp_path)
    three = build_supervisor(parse_args(["--sidecar-workers", "3"]), model, "m").sidecar_command
    assert three[1:3] == ["-m", "openai_frontend"] and "--workers=3" in three
    default = build_supervisor(parse_args([]), model, "m").sidecar_command
    assert not any(arg.startswith("--workers") for arg in default)
    with pytest.raises(SystemExit):
        parse_args(["--sidecar-workers", "0"])


def test_tool_call_parser_flag_reaches_the_sidecar_command_line(tmp_path, monkeypatch, capsys):
    """``--tool-call-parser llama3_json``, or ``TRITONLLM_TOOL_CALL_PARSER`` (the flag wins),
    runs the sidecar with that parser, as the sidecar's own argument parser reads its command
    line (the launcher rejected the flag: Llama 3 models were stuck with hermes); without either
    (or with the variable empty) the command has no such flag: the sidecar's default, hermes.
    An unknown parser, flag or variable, is a usage error; the choices are the sidecar's."""
    from openai_frontend.app import parse_args as sidecar_args
    from openai_frontend.tool_parsers import TOOL_PARSERS
    from tritonllm.launch import TOOL_CALL_PARSER_ENV, TOOL_CALL_PARSERS, build_supervisor

    assert sorted(TOOL_CALL_PARSERS) == sorted(TOOL_PARSERS)

    def sidecar_parser(argv: list[str]) -> str:
        command = build_supervisor(parse_args(argv), str(tmp_path), "m").sidecar_command
        assert command[1:3] == ["-m", "openai_frontend"]
        if "--tool-call-parser" not in argv and not os.environ.get(TOOL_CALL_PARSER_ENV):
            assert not any(arg.startswith("--tool-call-parser") for arg in command)
        return sidecar_args(command[3:]).tool_call_parser

    monkeypatch.delenv(TOOL_CALL_PARSER_ENV, raising=False)
    assert sidecar_parser(["--tool-call-parser", "llama3_json"]) == "llama3_json"
    assert sidecar_parser([]) == "hermes"
    monkeypatch.setenv(TOOL_CALL_PARSER_ENV, "llama3_json")
    assert sidecar_parser([]) == "llama3_json"
    assert sidecar_parser(["--tool-call-parser", "hermes"]) == "hermes"
    monkeypatch.setenv(TOOL_CALL_PARSER_ENV, "")
    assert sidecar_parser([]) == "hermes"
    for argv, variable in ((["--tool-call-parser", "mistral"], ""), ([], "mistral")):
        monkeypatch.setenv(TOOL_CALL_PARSER_ENV, variable)
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and "mistral" in capsys.readouterr().err


def test_generator_instances_flag_reaches_every_tritonserver(tmp_path, capsys):
    """``--generator-instances 4`` makes every tritonserver the supervisor starts, restarts
    included, serve 4 generator instances; without it, 1; below 1 or no integer is a usage
    error."""
    from tritonllm.launch import build_supervisor

    model = str(tmp_path)
    four = build_supervisor(parse_args(["--generator-instances", "4"]), model, "m")
    assert four.new_triton().generator_instances == four.new_triton().generator_instances == 4
    assert build_supervisor(parse_args([]), model, "m").new_triton().generator_instances == 1
    for bad in ("0", "x"):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--generator-instances", bad])
        assert exit_.value.code == 2 and "--generator-instances" in capsys.readouterr().err


def test_generator_instances_without_an_engine_process_is_a_usage_error(monkeypatch, capsys):
    """Instances share an engine process: with ``TRITONLLM_ENGINE_PROCESS=false`` the launcher
    says so before it starts anything (tritonserver would fail every instance's load)."""
    monkeypatch.setenv("TRITONLLM_ENGINE_PROCESS", "false")
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--generator-instances", "2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "TRITONLLM_ENGINE_PROCESS=false" in err
    assert parse_args(["--generator-instances", "1"]).generator_instances == 1


def test_repository_copy_sets_the_generator_instances_and_links_the_rest(tmp_path):
    """The copy differs from the repository in the generator's instance count alone: every
    other model is a symlink to the original, the generator's version directory too, so its
    model.py resolves into the original repository (where it finds the project root).
    Removing the copy leaves the original whole."""
    original = MODEL_REPOSITORY / "generator" / "config.pbtxt"
    repo = repository_with_instances(MODEL_REPOSITORY, "generator", 3, tmp_path)
    assert repo == tmp_path / "model_repository"
    config = (repo / "generator" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 3 kind: KIND_CPU } ]" in config
    assert config == original.read_text().replace(
        "instance_group [ { count: 1 kind: KIND_CPU } ]",
        "instance_group [ { count: 3 kind: KIND_CPU } ]",
    )
    models = {p.name for p in MODEL_REPOSITORY.iterdir() if p.is_dir()}
    assert {p.name for p in repo.iterdir()} == models
    for name in models - {"generator"}:
        assert (repo / name).is_symlink()
        assert (repo / name).resolve() == (MODEL_REPOSITORY / name).resolve()
    assert not (repo / "generator").is_symlink() and (repo / "generator" / "1").is_symlink()
    model_py = (repo / "generator" / "1" / "model.py").resolve()
    assert model_py == (MODEL_REPOSITORY / "generator" / "1" / "model.py").resolve()
    assert model_py.parents[3] == REPO_ROOT.resolve()
    shutil.rmtree(repo)
    assert (MODEL_REPOSITORY / "generator" / "1" / "model.py").is_file()
    assert "count: 1 kind: KIND_CPU" in original.read_text()


def _repository(root: Path, config: str) -> Path:
    (root / "generator" / "1").mkdir(parents=True)
    (root / "generator" / "config.pbtxt").write_text(config)
    (root / "tokenizer").mkdir()
    return root


@pytest.mark.parametrize(
    "config",
    [
        'name: "generator"\n',  # no instance_group: Triton's default, no count to set
        "instance_group [ { kind: KIND_CPU } ]\n",
        "instance_group [ { count: 1 kind: KIND_CPU }, { count: 2 kind: KIND_CPU } ]\n",
        "instance_group [ { count: 1 } ]\ninstance_group [ { count: 1 } ]\n",
        "# instance_group [ { count: 1 kind: KIND_CPU } ]\n",
    ],
)
def test_a_generator_config_without_one_instance_count_is_refused(tmp_path, config):
    source = _repository(tmp_path / "source", config)
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(RuntimeError, match="config.pbtxt: expected one instance_group"):
        repository_with_instances(source, "generator", 2, into)
    assert list(into.iterdir()) == []  # nothing made before the refusal


def test_only_the_instance_groups_count_is_set(tmp_path):
    """A count outside the instance_group (a parameter's, a comment's) stays as it was, and
    so does the rest of the group."""
    config = (
        "# instance_group [ { count: 8 } ]\n"
        'parameters { key: "count" value: { string_value: "count: 5" } }\n'
        "instance_group [\n  {\n    count : 1\n    kind: KIND_GPU\n    gpus: [ 0 ]\n  }\n]\n"
    )
    source = _repository(tmp_path / "source", config)
    (tmp_path / "into").mkdir()
    repo = repository_with_instances(source, "generator", 4, tmp_path / "into")
    assert (repo / "generator" / "config.pbtxt").read_text() == config.replace(
        "count : 1", "count: 4"
    )
    with pytest.raises(ValueError, match="instances"):
        repository_with_instances(source, "generator", 0, tmp_path / "other")
    with pytest.raises(ValueError, match="generator_instances"):
        TritonServer(generator_instances=0)


def test_a_second_stop_signal_does_not_interrupt_the_first():
    """`kill` of `make serve`'s process group reaches the launcher twice (directly, and
    forwarded by make): the first raises the stop, the second is ignored, so the drain that
    the first started is not cut short by a second `_Stop` (QA: a traceback, exit 1)."""
    from tritonllm import launch

    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGTERM, launch._raise_stop)
        signal.signal(signal.SIGINT, launch._raise_stop)
        with pytest.raises(launch._Stop) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode
        assert stop.value.graceful
        os.kill(os.getpid(), signal.SIGTERM)  # make's forwarded copy, while draining
        time.sleep(0.2)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, saved[0])
        signal.signal(signal.SIGINT, saved[1])


def _shell_expanded(command: str, env: dict[str, str]) -> str:
    """The arguments of ``command`` (a curl command line) as bash expands them with ``env``,
    one a line, instead of running curl."""
    assert command.startswith("curl ")
    words = "printf '%s\\n' " + command.removeprefix("curl ")
    return subprocess.run(["bash", "-c", words], env=env, capture_output=True, text=True).stdout


def test_startup_hint_reads_the_key_from_the_shell_it_is_pasted_into(monkeypatch):
    """The banner's curl command sends the first of ``$TRITONLLM_API_KEY``'s keys as the shell
    it is pasted into expands it, and no key is printed. When the key came from ``--api-key``
    or ``make serve API_KEY=...`` that shell lacks the variable (the pasted command got a 401):
    a line before it says to export it. Without keys, no Authorization header."""
    from tritonllm.launch import API_KEY_ENV, API_KEY_FROM_MAKE_ENV, _banner

    export = f"`export {API_KEY_ENV}=<your API key>`"
    pasted_into = {"PATH": os.environ["PATH"], API_KEY_ENV: "k-one,k-two"}
    cases = [
        ([], {API_KEY_ENV: "k-one,k-two"}, False),
        (["--api-key=k-flag"], {}, True),
        (["--api-key=k-flag"], {API_KEY_ENV: "k-env"}, True),
        ([], {API_KEY_ENV: "k-make", API_KEY_FROM_MAKE_ENV: "1"}, True),
    ]
    for argv, env, says_export in cases:
        for name in (API_KEY_ENV, API_KEY_FROM_MAKE_ENV):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        text = _banner(parse_args(argv), "m")
        assert not re.search(r"k-(one|flag|env|make)", text), text
        assert (export in text) == says_export, (argv, env, text)
        curl = re.search(r"^try: (curl .*)$", text, re.MULTILINE)[1]
        assert "Authorization: Bearer k-one\n" in _shell_expanded(curl, pasted_into)
        if says_export:
            assert text.index(export) < text.index(curl)

    monkeypatch.delenv(API_KEY_ENV)
    monkeypatch.delenv(API_KEY_FROM_MAKE_ENV)
    assert "Authorization" not in _banner(parse_args([]), "m")


def test_sidecar_limit_flags_reach_the_sidecar_and_bad_values_are_usage_errors(tmp_path, capsys):
    """The launcher's ``--max-request-bytes``, ``--body-timeout``, ``--header-timeout`` and
    ``--stream-idle-timeout`` run the sidecar with those values, as its own parser reads them
    (the launcher had none of them: an operator behind a slow proxy could not raise the 30 s
    body timeout); without them the sidecar keeps its defaults. A negative or non-numeric value
    is a usage error of either program naming the flag, and so is a header timeout of 0, which
    made the sidecar close every connection at once."""
    from openai_frontend.app import parse_args as sidecar_args
    from tritonllm.launch import build_supervisor

    argv = [
        "--max-request-bytes", "1048576", "--body-timeout", "60", "--header-timeout", "2.5",
        "--stream-idle-timeout", "0",
    ]  # fmt: skip
    command = build_supervisor(parse_args(argv), str(tmp_path), "m").sidecar_command
    assert command[1:3] == ["-m", "openai_frontend"]
    given = sidecar_args(command[3:])
    assert (given.max_request_bytes, given.body_timeout) == (1048576, 60.0)
    assert (given.header_timeout, given.stream_idle_timeout) == (2.5, 0.0)
    default = build_supervisor(parse_args([]), str(tmp_path), "m").sidecar_command
    limits = ("max_request_bytes", "body_timeout", "header_timeout", "stream_idle_timeout")
    own, defaults = sidecar_args(default[3:]), sidecar_args([])
    assert [getattr(own, k) for k in limits] == [getattr(defaults, k) for k in limits]
    bad = [
        ("--max-request-bytes", "0"), ("--body-timeout", "-1"), ("--header-timeout", "0"),
        ("--stream-idle-timeout", "nan"), ("--drain-timeout", "-5"), ("--body-timeout", "soon"),
    ]  # fmt: skip
    for flag, value in bad:
        for parse in (parse_args, sidecar_args):
            with pytest.raises(SystemExit) as exit_:
                parse([flag, value])
            assert exit_.value.code == 2 and flag in capsys.readouterr().err
