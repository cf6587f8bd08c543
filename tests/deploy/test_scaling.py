"""Scaling out with the chart: replicas behind the router, parallelism inside a pod.

Rendered by Helm's own engine like tests/deploy/test_helm_chart.py (which also validates these
scenarios against the Kubernetes schemas). Checks that the router finds exactly the server pods
and nothing else, that its RBAC is only what its pod discovery needs, that the parallelism values
become vLLM's flags, and that every invalid combination stops ``helm install`` with a message that
names the values to change. Nothing here talks to a cluster or runs the router image.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.deploy.test_helm_chart import CHART, SCENARIOS, render

try:
    import helm_python as helm
except ImportError as err:  # dev extra: helm-python-sdk
    pytest.fail(f"{err.name} missing: pip install helm-python-sdk", pytrace=False)

SCALING = ("router", "routerPrefixHpa", "parallel", "cpuDataParallel")
ROUTER = "demo-vllm-kvcomp-router"
SERVER = "demo-vllm-kvcomp"


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def named(docs, kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for ds in docs.values() for d in ds if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def kinds(docs) -> list[tuple[str, str]]:
    return sorted((d["kind"], d["metadata"]["name"]) for ds in docs.values() for d in ds)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def pod_labels(deployment) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


# ---------------------------------------------------------------------------- router


def test_router_is_off_by_default(chart):
    assert not [kind for kind in kinds(render(chart)) if kind[1] == ROUTER]


def test_router_finds_exactly_the_server_pods(chart):
    docs = render(chart, SCENARIOS["router"])
    server, router = named(docs, "Deployment", SERVER), named(docs, "Deployment", ROUTER)
    assert server["spec"]["replicas"] == 3 and router["spec"]["replicas"] == 1
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(args, "--service-discovery") == "k8s" and flag(args, "--k8s-service-discovery-type") == "pod-ip"
    assert flag(args, "--k8s-namespace") == "ml"
    discovery = dict(term.split("=", 1) for term in flag(args, "--k8s-label-selector").split(","))
    assert discovery == server["spec"]["selector"]["matchLabels"]
    assert selects(discovery, pod_labels(server)) and not selects(discovery, pod_labels(router))
    server_port = server["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert flag(args, "--k8s-port") == str(server_port)
    assert (flag(args, "--routing-logic"), flag(args, "--session-key")) == ("session", "x-session-id")
    # the server Service and the ServiceMonitor never reach the router pods; the router's Service
    # reaches only them
    server_service, router_service = named(docs, "Service", SERVER), named(docs, "Service", ROUTER)
    assert not selects(server_service["spec"]["selector"], pod_labels(router))
    assert selects(router_service["spec"]["selector"], pod_labels(router))
    assert not selects(router_service["spec"]["selector"], pod_labels(server))
    monitor = named(docs, "ServiceMonitor", SERVER)
    assert selects(monitor["spec"]["selector"]["matchLabels"], server_service["metadata"]["labels"])
    assert not selects(monitor["spec"]["selector"]["matchLabels"], router_service["metadata"]["labels"])
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert router_service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"] == "http"
    assert container["ports"][0]["containerPort"] == int(flag(args, "--port"))


def test_router_rbac_is_pod_discovery_only(chart):
    docs = render(chart, SCENARIOS["router"])
    router = named(docs, "Deployment", ROUTER)["spec"]["template"]["spec"]
    role, binding = named(docs, "Role", ROUTER), named(docs, "RoleBinding", ROUTER)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROUTER}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ROUTER, "namespace": "ml"}]
    assert router["serviceAccountName"] == named(docs, "ServiceAccount", ROUTER)["metadata"]["name"]
    assert router["automountServiceAccountToken"] is True  # it talks to the Kubernetes API
    server = named(docs, "Deployment", SERVER)["spec"]["template"]["spec"]
    assert server["automountServiceAccountToken"] is False and server["serviceAccountName"] == SERVER
    assert "ClusterRole" not in {kind for kind, _ in kinds(docs)}


def test_router_pod_runs_as_non_root_without_gpus(chart):
    docs = render(chart, SCENARIOS["router"])
    pod = named(docs, "Deployment", ROUTER)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert not any("gpu" in key for part in container["resources"].values() for key in part)
    assert "tolerations" not in pod and "nodeSelector" not in pod
    assert container["image"] == "lmcache/lmstack-router:v0.1.12"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    key = {e["name"]: e for e in container["env"]}["VLLM_API_KEY"]  # it reads the servers' /v1/models
    assert key["valueFrom"]["secretKeyRef"] == {"name": "api", "key": "api-key"}
    assert "env" not in named(render(chart, {"replicaCount": 2, "router": {"enabled": True}}),
                              "Deployment", ROUTER)["spec"]["template"]["spec"]["containers"][0]


def test_prefix_routing_behind_an_autoscaler(chart):
    docs = render(chart, SCENARIOS["routerPrefixHpa"])
    args = named(docs, "Deployment", ROUTER)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(args, "--routing-logic") == "prefixaware" and "--session-key" not in args
    hpa = named(docs, "HorizontalPodAutoscaler", SERVER)
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert "replicas" not in named(docs, "Deployment", SERVER)["spec"]  # the HPA owns it
    assert named(docs, "Service", ROUTER)["spec"]["type"] == "LoadBalancer"


def test_helm_test_and_notes_go_through_the_router(chart):
    values = SCENARIOS["router"]
    script = render(chart, values)["tests/test-connection.yaml"][0]["spec"]["containers"][0]["args"][0]
    assert f'router="http://{ROUTER}:8000"' in script
    assert '"$router/health"' in script and '"$router/v1/models"' in script
    notes = chart.render(values, name="demo", namespace="ml")["vllm-kvcomp/templates/NOTES.txt"]
    assert f"port-forward service/{ROUTER} 8000:8000" in notes and "x-session-id: <conversation id>" in notes
    assert "router" not in render(chart)["tests/test-connection.yaml"][0]["spec"]["containers"][0]["args"][0]


@pytest.mark.parametrize("scenario", SCALING)
def test_helm_lint_strict_is_clean_when_scaled_out(scenario):
    report = helm.lint(CHART, SCENARIOS[scenario], strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


# ---------------------------------------------------------------------------- parallelism


def test_parallelism_becomes_vllms_flags(chart):
    container = render(chart, SCENARIOS["parallel"])
    (server,) = named(container, "Deployment", SERVER)["spec"]["template"]["spec"]["containers"]
    args = server["args"]
    assert (flag(args, "--tensor-parallel-size"), flag(args, "--data-parallel-size")) == ("4", "2")
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 8
    cpu = named(render(chart, SCENARIOS["cpuDataParallel"]), "Deployment", SERVER)["spec"]["template"]["spec"]
    args = cpu["containers"][0]["args"]
    assert flag(args, "--data-parallel-size") == "2" and "--tensor-parallel-size" not in args
    assert {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0-15|16-31"} in cpu["containers"][0]["env"]
    default = named(render(chart), "Deployment", SERVER)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--tensor-parallel-size" not in default and "--data-parallel-size" not in default


# ---------------------------------------------------------------------------- invalid combinations


INVALID = [
    ({"router": {"enabled": True}},
     "router.enabled needs 2 or more server pods to route between: set replicaCount to 2 or more (now 1)"),
    ({"router": {"enabled": True}, "autoscaling": {"enabled": True}},
     "router.enabled needs 2 or more server pods to route between: set autoscaling.minReplicas to 2 or more (now 1)"),
    ({"replicaCount": 3, "autoscaling": {"enabled": True}},
     "replicaCount (3) conflicts with autoscaling.enabled: the HorizontalPodAutoscaler owns the replica count"),
    ({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 4}},
     "autoscaling.minReplicas (5) is above autoscaling.maxReplicas (4)."),
    ({"replicaCount": 2, "router": {"enabled": True}, "gpu": {"count": 2}, "parallelism": {"data": 2}},
     "router.enabled with parallelism.data 2: the router picks a pod, but vLLM spreads"),
    ({"replicaCount": 2, "router": {"enabled": True, "routing": "prefix", "replicaCount": 2}},
     "router.routing prefix with router.replicaCount 2: each router pod keeps its own prefix table"),
    ({"parallelism": {"tensor": 2}},
     "gpu.count (1) is less than parallelism.tensor x parallelism.data (2 x 1 = 2)"),
    ({"gpu": {"count": 6}, "parallelism": {"tensor": 4, "data": 2}},
     "gpu.count (6) is less than parallelism.tensor x parallelism.data (4 x 2 = 8)"),
    ({"gpu": {"count": 2}, "server": {"extraArgs": ["--tensor-parallel-size", "2"]}},
     "server.extraArgs sets --tensor-parallel-size: set parallelism.tensor instead"),
    ({"server": {"extraArgs": ["-tp", 1]}}, "server.extraArgs sets -tp: set parallelism.tensor instead"),
    ({"gpu": {"count": 0}, "server": {"extraArgs": ["--data_parallel_size=2"]}},
     "server.extraArgs sets --data_parallel_size=2: set parallelism.data instead"),
]


@pytest.mark.parametrize(("values", "message"), INVALID)
def test_invalid_combinations_stop_the_install_with_the_values_to_change(chart, values, message):
    chart.validate_schema(chart.merge_values(values))  # each value is fine on its own
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        chart.render(values, name="demo", namespace="ml")


def test_valid_neighbours_of_the_invalid_combinations_render(chart):
    for values in (
        {"replicaCount": 2, "router": {"enabled": True}},
        {"autoscaling": {"enabled": True, "minReplicas": 2}, "router": {"enabled": True, "replicaCount": 3}},
        {"autoscaling": {"enabled": True, "minReplicas": 4, "maxReplicas": 4}},
        {"gpu": {"count": 0}, "parallelism": {"tensor": 2, "data": 2}},
        {"gpu": {"count": 8}, "parallelism": {"tensor": 2, "data": 2}},  # e.g. --pipeline-parallel-size 2
        {"replicaCount": 2, "router": {"enabled": True, "routing": "prefix"}},
        {"server": {"extraArgs": ["--pipeline-parallel-size", "1", "--data-parallel-size-local", "1"]}},
    ):
        assert named(render(chart, values), "Deployment", SERVER)
