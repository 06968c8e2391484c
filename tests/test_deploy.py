"""deploy/kubernetes.yaml: every document valid against Kubernetes' schemas (kubernetes-validate,
strict: an unknown or misspelt field fails), and true to pagedllm: the container's arguments
parse as `pagedllm` flags, the probes ask routes the server has, and every port named matches
the one the server or its KV event publisher binds. deploy/Dockerfile runs `pagedllm` with them.
(No cluster and no Docker here: neither the image nor the Deployment was run.)"""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pagedllm.config import KVEventsConfig
from pagedllm.entrypoints.cli import build_parser, engine_args_from
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig
from tests.entrypoints.test_openai_protocol import _stub_engine

DEPLOY = Path(__file__).parent.parent / "deploy"
KUBERNETES_VERSION = "1.30.0"  # preStop's sleep action is there from 1.30


def documents() -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))


@pytest.mark.parametrize("index", range(3))
def test_each_document_is_valid_kubernetes(index):
    document = documents()[index]
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    broken = json.loads(json.dumps(document))
    broken["spec"]["replicaz"] = 2  # the validator does catch a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_manifest_agrees_with_pagedllm():
    deployment, service, replicas = documents()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ns = build_parser().parse_args(container["args"])
    engine_args_from(ns).validate()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ns.command == "serve" and ports["http"] == ns.port and ns.host == "0.0.0.0"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ns.port
    routes = {route.path for route in build_app(_stub_engine(), ServerConfig("m")).routes}
    assert annotations["prometheus.io/path"] in routes
    for probe, path in (("startupProbe", "/health"), ("livenessProbe", "/health"),
                        ("readinessProbe", "/ready")):  # fmt: skip
        assert container[probe]["httpGet"] == {"path": path, "port": "http"} and path in routes
    events = KVEventsConfig.parse(ns.kv_events_config)
    assert ports["kv-events"] == int(events.endpoint.rsplit(":", 1)[1])
    assert ports["kv-replay"] == int(events.replay_endpoint.rsplit(":", 1)[1])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert grace > ns.graceful_shutdown_timeout + pause
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for svc in (service, replicas):
        assert svc["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports.keys()
    assert replicas["spec"]["clusterIP"] == "None"  # headless: one record per replica


def test_the_image_runs_pagedllm_serve():
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    assert 'ENTRYPOINT ["pagedllm"]' in lines
    (cmd,) = [json.loads(line[4:]) for line in lines if line.startswith("CMD ")]
    ns = build_parser().parse_args(cmd)
    assert (ns.command, ns.host, ns.port) == ("serve", "0.0.0.0", 8000)
