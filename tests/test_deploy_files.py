"""``docker/`` and ``deploy/`` checked offline (no Docker engine, registry or cluster here):

- every file parses (Dockerfile instructions, compose and Kubernetes YAML, Prometheus YAML,
  the Grafana dashboard's JSON); the Kubernetes manifests pass the API's JSON schemas
  (kubernetes-validate bundles them), strictly;
- every path, port, command and ``TRITONLLM_*`` variable they name exists in the project: the
  launcher's flags parse with its own parser, the probes and published ports are the ports of
  the tritonserver and sidecar command lines that the launcher itself builds
  (``launch.build_supervisor``), the variables are the ones ``tritonllm/triton_config.py``
  documents or the launcher reads;
- the image's Triton release is the one these tests run (2.51.0 = NGC 24.10);
- every metric the dashboard names exists on a live server (new panels are checked too).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from unittest import mock

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import tritonllm.launch as launch
import tritonllm.triton_config as triton_config
from openai_frontend.app import create_app
from tritonllm.triton_server import TritonInstall

# Dev dependencies (make setup installs them; CI has them): the GPU host's image does not, and
# there the GPU-marked run only collects this file.
kubernetes_validate = pytest.importorskip("kubernetes_validate")
DockerfileParser = pytest.importorskip("dockerfile_parse").DockerfileParser

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKER, DEPLOY = REPO_ROOT / "docker", REPO_ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DASHBOARD = DEPLOY / "grafana" / "tritonllm-dashboard.json"
# NGC container release of each Triton Inference Server version (NVIDIA's release notes).
NGC_RELEASE = {"2.51.0": "24.10"}
# The image's own tritonserver (find_tritonserver: on PATH, backends in /opt/tritonserver).
IMAGE_INSTALL = TritonInstall(
    Path("/opt/tritonserver/bin/tritonserver"), Path("/opt/tritonserver/backends")
)
# Variables the launcher reads itself (tritonllm/launch.py); the rest are documented in
# tritonllm/triton_config.py's table.
LAUNCHER_ENV = {
    launch.API_KEY_ENV,
    "TRITONLLM_MODEL",
    "TRITONLLM_HOST",
    "TRITONLLM_TRITON_HOST",
    "TRITONLLM_ON_FAILURE",
    launch.TOOL_CALL_PARSER_ENV,
}


def documented_variables() -> set[str]:
    return set(re.findall(r"``(TRITONLLM_[A-Z_]+)``", triton_config.__doc__)) | LAUNCHER_ENV


def interpolate(text: str) -> str:
    """Compose's ``${NAME:-default}`` with every variable unset (its defaults)."""
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)
    assert "${" not in text, f"a variable without a default: {text}"
    return text


def sidecar_routes() -> set[str]:
    return set(create_app("127.0.0.1:1", "m").openapi()["paths"])


def check_launcher(args: list[str], env: dict[str, str]) -> launch.LaunchConfig:
    """Parse ``args`` with the launcher's parser; check what a container needs of them, and
    that the two command lines the launcher builds from them listen where ``cfg`` says."""
    cfg = launch.parse_args(args)
    assert cfg.host == "0.0.0.0", "the OpenAI API must be reachable from outside the container"
    assert cfg.triton_host == "0.0.0.0", "the metrics port must be reachable by Prometheus"
    assert cfg.policy.on_failure == "exit", "in a container the orchestrator restarts"
    assert set(env) <= documented_variables(), set(env) - documented_variables()
    parser = env.get(launch.TOOL_CALL_PARSER_ENV) or None  # empty: the sidecar's default
    assert parser in (None, *launch.TOOL_CALL_PARSERS), parser
    model = env.get("TRITONLLM_MODEL") or cfg.model or str(launch.DEFAULT_MODEL_DIR)
    supervisor = launch.build_supervisor(cfg, model, cfg.model_name or launch.served_name(model))
    sidecar = supervisor.sidecar_command
    assert sidecar[1:3] == ["-m", "openai_frontend"]
    assert f"--port={cfg.port}" in sidecar and "--host=0.0.0.0" in sidecar
    assert f"--triton-url=127.0.0.1:{cfg.grpc_port}" in sidecar
    assert f"--drain-timeout={cfg.policy.drain_timeout_s:g}" in sidecar
    triton = supervisor.new_triton()
    command = triton.command(IMAGE_INSTALL)
    for flag in ("http", "grpc", "metrics"):
        assert f"--{flag}-address=0.0.0.0" in command
        assert f"--{flag}-port={getattr(cfg, flag + '_port')}" in command
    assert triton.environment(IMAGE_INSTALL)["TRITONLLM_MODEL"] == model
    with mock.patch.dict(
        os.environ, {"TRITONLLM_API_KEY": "sk-tenant", "TRITONLLM_ADMIN_KEY": "a"}
    ):
        # the sidecar's keys and the admin key stay out of every model stub's environment
        assert not {"TRITONLLM_API_KEY", "TRITONLLM_ADMIN_KEY"} & set(
            triton.environment(IMAGE_INSTALL)
        )
    assert supervisor.health_url == f"http://127.0.0.1:{cfg.port}/health"
    return cfg


def health_url_of(command: str) -> str:
    found = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)", command)
    assert found, command
    return found.group(0)


# --- docker/ ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(DOCKER / "Dockerfile"))


def _instructions(parser: DockerfileParser, name: str) -> list[str]:
    return [item["value"] for item in parser.structure if item["instruction"] == name]


def test_dockerfile_builds_on_the_triton_release_the_tests_run(dockerfile, triton_server):
    version = httpx.get(f"http://{triton_server.http_url}/v2", timeout=10).json()["version"]
    tag = NGC_RELEASE[version]
    assert dockerfile.baseimage == f"nvcr.io/nvidia/tritonserver:{tag}-py3"


def test_dockerfile_names_only_what_the_project_has(dockerfile):
    args = dockerfile.args
    for value in _instructions(dockerfile, "COPY"):
        *sources, _ = shlex.split(value)
        for source in sources:
            source = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], source)
            assert (REPO_ROOT / source).exists(), source
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    runs = " ".join(_instructions(dockerfile, "RUN"))
    extras = re.search(r'pip install -e "\.\[\$\{EXTRAS\}\]"', runs)
    assert extras, runs
    for extra in args["EXTRAS"].split(","):
        assert re.search(rf"(?m)^{extra} = \[", pyproject), extra
    assert '"numpy<2"' in runs  # the Python backend stub's requirement
    assert "python3 -m tritonllm.build_model --shape tiny --out models/tiny-qwen3" in runs
    assert {n for n in dockerfile.envs if n.startswith("TRITONLLM_")} <= documented_variables()


def test_dockerfile_runs_the_launcher_on_the_ports_it_exposes(dockerfile):
    (entrypoint,) = _instructions(dockerfile, "ENTRYPOINT")
    assert json.loads(entrypoint) == ["python3", "-m", "tritonllm.launch"]
    (cmd,) = _instructions(dockerfile, "CMD")
    env = {k: v for k, v in dockerfile.envs.items() if k.startswith("TRITONLLM_")}
    cfg = check_launcher(json.loads(cmd), env)
    (exposed,) = _instructions(dockerfile, "EXPOSE")
    assert {int(p) for p in exposed.split()} == {
        cfg.port,
        cfg.http_port,
        cfg.grpc_port,
        cfg.metrics_port,
    }
    (healthcheck,) = _instructions(dockerfile, "HEALTHCHECK")
    url = health_url_of(healthcheck)
    assert url == f"http://127.0.0.1:{cfg.port}/health" and "/health" in sidecar_routes()


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(interpolate((DOCKER / "compose.yaml").read_text()))


def test_compose_runs_the_launcher_with_a_gpu_health_checks_and_the_model_volume(compose):
    service = compose["services"]["tritonllm"]
    build = service["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    cfg = check_launcher(service["command"], service["environment"])
    published = {int(p.split(":")[1].split("/")[0]) for p in service["ports"]}
    assert published == {cfg.port, cfg.metrics_port}
    assert health_url_of(" ".join(service["healthcheck"]["test"])).endswith(f":{cfg.port}/health")
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert service["shm_size"]  # the Python backend's /dev/shm
    (volume,) = service["volumes"]
    source, target, _ = volume.split(":")
    assert (DOCKER / source).resolve() == REPO_ROOT / "models" / "tiny-qwen3"  # make tiny-model
    assert service["environment"]["TRITONLLM_MODEL"] == target
    # The API key comes from the user's shell, never from a literal in the file.
    raw = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["tritonllm"]
    assert raw["environment"][launch.API_KEY_ENV] == f"${{{launch.API_KEY_ENV}:-}}"
    grace = int(service["stop_grace_period"].removesuffix("s"))
    assert grace >= cfg.policy.drain_timeout_s + 20  # the drain, then tritonserver's stop
    for name in ("prometheus", "grafana"):
        for mount in compose["services"][name]["volumes"]:
            assert (DOCKER / mount.split(":")[0]).exists(), mount


def test_prometheus_scrapes_the_metrics_port(compose):
    cfg = launch.parse_args(compose["services"]["tritonllm"]["command"])
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    assert static["targets"] == [f"tritonllm:{cfg.metrics_port}"] and job["metrics_path"] == (
        "/metrics"
    )
    in_cluster = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-kubernetes.yml").read_text())
    (job,) = in_cluster["scrape_configs"]
    labels = {s for rule in job["relabel_configs"] for s in rule.get("source_labels", [])}
    for annotation in ("scrape", "port", "path"):
        assert f"__meta_kubernetes_pod_annotation_prometheus_io_{annotation}" in labels


# --- deploy/kubernetes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    found = {}
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((KUBERNETES / resource).read_text()):
            found[doc["kind"]] = doc
    return found


@pytest.mark.parametrize("version", ["1.29.0", kubernetes_validate.latest_version()])
def test_kubernetes_manifests_pass_the_api_schemas(manifests, version):
    for kind, doc in manifests.items():
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError
        assert kind in ("Deployment", "Service", "PodDisruptionBudget", "PersistentVolumeClaim")


def test_kubernetes_pods_are_probed_drained_limited_and_scraped(manifests):
    deployment = manifests["Deployment"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    cfg = check_launcher(container["args"], env)
    # Every variable is a literal but the API key, which comes from an optional Secret.
    from_elsewhere = {e["name"]: e["valueFrom"] for e in container["env"] if "value" not in e}
    assert from_elsewhere == {
        launch.API_KEY_ENV: {
            "secretKeyRef": {"name": "tritonllm-api-key", "key": "api-key", "optional": True}
        }
    }
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "openai": cfg.port,
        "triton-http": cfg.http_port,
        "triton-grpc": cfg.grpc_port,
        "metrics": cfg.metrics_port,
    }
    probes = {
        kind: (container[kind]["httpGet"]["path"], ports[container[kind]["httpGet"]["port"]])
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert probes == {
        "startupProbe": ("/v2/health/ready", cfg.http_port),
        "readinessProbe": ("/health", cfg.port),
        "livenessProbe": ("/v2/health/live", cfg.http_port),
    }
    assert "/health" in sidecar_routes()
    # The readiness probe outlasts one /health probe generation (openai_frontend/health.py).
    assert container["readinessProbe"]["timeoutSeconds"] >= 10
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= int(pre_stop[1]) + cfg.policy.drain_timeout_s + 20
    for bound in ("requests", "limits"):
        assert container["resources"][bound]["nvidia.com/gpu"] == "1"
        assert container["resources"][bound]["memory"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["dshm"]["emptyDir"]["sizeLimit"]
    assert mounts["model"] == env["TRITONLLM_MODEL"]
    claim = volumes["model"]["persistentVolumeClaim"]["claimName"]
    assert claim == manifests["PersistentVolumeClaim"]["metadata"]["name"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == cfg.metrics_port
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == labels
    service = manifests["Service"]["spec"]
    assert service["selector"] == labels and service["sessionAffinity"] == "None"
    assert [p["targetPort"] for p in service["ports"]] == ["openai"]


# --- the dashboard ----------------------------------------------------------------------------

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or"}
_PROMQL_WORDS |= {"unless", "offset", "bool", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, labels and keywords left out)."""
    expr = re.sub(r'"[^"]*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[match.end() :].lstrip()
        if not rest.startswith("(") and match.group(0).lower() not in _PROMQL_WORDS:
            names.add(match.group(0))
    return names


def dashboard_metrics() -> dict[str, set[str]]:
    """metric name -> the titles of the panels that read it."""
    dashboard = json.loads(DASHBOARD.read_text())
    used: dict[str, set[str]] = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            for name in metric_names(target["expr"]):
                used.setdefault(name, set()).add(panel["title"])
    return used


def exported_names(url: str) -> set[str]:
    """Every family and sample name on a Prometheus endpoint (none where there is none)."""
    response = httpx.get(url, timeout=10)
    if response.status_code == 404:
        return set()
    response.raise_for_status()
    names = set()
    for family in text_string_to_metric_families(response.text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def test_metric_names_are_read_from_promql():
    expr = 'histogram_quantile(0.9, sum by (le) (rate(a_seconds_bucket{model="x"}[5m]))) / b'
    assert metric_names(expr) == {"a_seconds_bucket", "b"}


def test_every_metric_the_dashboard_names_exists_on_a_live_server(triton_server, sidecar):
    """tritonserver's metrics port and the sidecar's /metrics (where it has one) are the
    sources; a panel added later is checked the same way. GPU metrics (``nv_gpu_*``) are
    checked where the server exports GPU metrics at all (a GPU, and DCGM for Triton)."""
    httpx.post(  # every model has run once
        f"{sidecar.base_url}/completions",
        json={"model": sidecar.model_name, "prompt": "Hi", "max_tokens": 2},
        timeout=60,
    ).raise_for_status()
    exported = exported_names(triton_server.metrics_url)
    exported |= exported_names(f"{sidecar.root_url}/metrics")
    used = dashboard_metrics()
    assert len(used) >= 20, sorted(used)
    gpu = any(name.startswith("nv_gpu_") for name in exported)
    checked = {n: panels for n, panels in used.items() if gpu or not n.startswith("nv_gpu_")}
    missing = {name: panels for name, panels in checked.items() if name not in exported}
    assert missing == {}, missing
