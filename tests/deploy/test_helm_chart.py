"""The Helm chart, rendered by Helm's own engine (helm-python-sdk: the Helm v4 Go SDK).

Checks: Chart.yaml / values.yaml / values.schema.json parse and agree, ``helm lint --strict``,
every rendered manifest is YAML that validates against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict), the rendered operator config passes the server's own
validation, and the Deployment wires config, probes, GPUs and model sources as documented.
Nothing here talks to a cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

import vllm_kvcomp
from vllm_kvcomp.server.operator_config import OperatorConfig

try:
    import helm_python as helm
    import kubernetes_validate
except ImportError as err:  # dev extra: helm-python-sdk, kubernetes-validate
    pytest.fail(f"{err.name} missing: pip install helm-python-sdk kubernetes-validate", pytrace=False)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "vllm-kvcomp"
CONFIGS = ROOT / "configs"
KUBE_VERSIONS = ("1.25.0", "1.37.0")  # Chart.yaml kubeVersion floor, newest schemas shipped
CONFIG_PATH = "/etc/vllm-kvcomp/kv-compression.yaml"

SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "pvc": {"model": {"name": "/models/llama", "source": {"type": "pvc", "pvc": {"claimName": "models", "subPath": "llama"}}}},
    "hostPath": {"model": {"source": {"type": "hostPath", "hostPath": {"path": "/mnt/models"}}}},
    "initContainer": {
        "model": {
            "source": {"type": "initContainer", "initContainer": {"args": ["Qwen/Qwen2.5-7B-Instruct", "--local-dir", "/models/model"]}},
            "hfTokenSecret": {"name": "hf-token"},
        }
    },
    "everything": {
        "model": {"name": "Qwen/Qwen2.5-7B-Instruct", "servedModelName": "qwen"},
        "server": {"apiKeySecret": {"name": "api"}, "extraArgs": ["--max-model-len", 32768, "--enforce-eager"],
                   "extraEnv": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]},
        "gpu": {"count": 2},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
        "autoscaling": {"enabled": True},
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "extraVolumes": [{"name": "profiles", "configMap": {"name": "kvcomp-profiles"}}],
        "extraVolumeMounts": [{"name": "profiles", "mountPath": "/profiles"}],
        "compression": {"default": {"policy": "lagkv"}, "policies": {"lagkv": {"ratio": 0.25, "lag": 128}},
                        "profiles": {"razor": "/profiles/razor.json"}},
        "podAnnotations": {"team": "ml"},
        "priorityClassName": "inference",
        "imagePullSecrets": [{"name": "regcred"}],
    },
    "cpu": {"gpu": {"count": 0}, "tolerations": [], "image": {"tag": "0.1.0-cpu"}},
    # scaling out (docs/deploy.md, Scaling out; tests/deploy/test_scaling.py)
    "router": {"replicaCount": 3, "router": {"enabled": True}, "server": {"apiKeySecret": {"name": "api"}},
               "metrics": {"serviceMonitor": {"enabled": True}}},
    "routerPrefixHpa": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8},
                        "router": {"enabled": True, "routing": "prefix", "service": {"type": "LoadBalancer"}}},
    "parallel": {"gpu": {"count": 8}, "parallelism": {"tensor": 4, "data": 2}},
    "cpuDataParallel": {"gpu": {"count": 0}, "tolerations": [], "parallelism": {"data": 2},
                        "server": {"extraEnv": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0-15|16-31"}]}},
}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart, values: dict[str, Any] | None = None) -> dict[str, list[dict[str, Any]]]:
    """{template file: parsed YAML documents}; every template must parse."""
    out = chart.render(values or {}, name="demo", namespace="ml")
    docs = {}
    for name, text in out.items():
        if name.endswith(".yaml"):
            docs[name.split("templates/", 1)[1]] = [d for d in yaml.safe_load_all(text) if d]
    return docs


def one(docs: dict[str, list[dict[str, Any]]], kind: str) -> dict[str, Any]:
    (found,) = [d for ds in docs.values() for d in ds if d["kind"] == kind]
    return found


def server(docs) -> dict[str, Any]:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def rendered_operator_config(docs) -> dict[str, Any]:
    return yaml.safe_load(one(docs, "ConfigMap")["data"]["kv-compression.yaml"])


# ---------------------------------------------------------------------------- chart files


def test_chart_metadata():
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2" and meta["name"] == "vllm-kvcomp"
    assert meta["appVersion"] == vllm_kvcomp.__version__
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    assert f"vllm/vllm-openai:v{meta['annotations']['vllm-kvcomp/vllm-version']}" in dockerfile


def test_values_match_their_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)
    assert set(values) == set(schema["properties"])  # every value typed, every typed key present


def test_chart_schema_embeds_the_operator_config_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["compression"]
    expected = OperatorConfig.json_schema() | {"description": schema.get("description")}
    assert schema == expected, "out of date: run python deploy/helm/sync_schema.py"


def test_readme_values_table_is_current(tmp_path):
    """The chart README's values table is the one scripts/helm_values_table.py generates (which
    also fails on a value the schema leaves undescribed); its --check catches a stale copy."""
    def check(readme: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "helm_values_table.py"), "--check",
                               "--readme", str(readme)], capture_output=True, text=True, timeout=60)

    current = check(CHART / "README.md")
    assert current.returncode == 0, current.stderr
    stale = tmp_path / "README.md"
    stale.write_text((CHART / "README.md").read_text().replace("| `replicaCount` |", "| `replicas` |"))
    refused = check(stale)
    assert refused.returncode == 1 and "helm_values_table.py --write" in refused.stderr


def test_helm_lint_strict_is_clean():
    report = helm.lint(CHART, strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"compression": {"policies": {"lagkv": {"ratio": 2}}}}, "/compression/policies/lagkv/ratio"),
        ({"compression": {"allow": ["nope"]}}, "/compression/allow/0"),
        ({"compression": {"bounds": {"max_ratio": 0}}}, "/compression/bounds/max_ratio"),
        ({"gpu": {"count": -1}}, "/gpu/count"),
        ({"model": {"source": {"type": "s3"}}}, "/model/source/type"),
        ({"replicas": 2}, "replicas"),
        ({"router": {"routing": "roundrobin"}}, "/router/routing"),
        ({"router": {"sessionHeader": "x session"}}, "/router/sessionHeader"),
        ({"router": {"sessionHeader": ""}}, "/router/sessionHeader"),
        ({"router": {"replicaCount": 0}}, "/router/replicaCount"),
        ({"router": {"sticky": True}}, "/router"),
        ({"parallelism": {"data": 0}}, "/parallelism/data"),
        ({"parallelism": {"tensor": 1.5}}, "/parallelism/tensor"),
        ({"parallelism": {"pipeline": 2}}, "/parallelism"),
    ],
)
def test_helm_rejects_values_outside_the_schema(chart, values, where):
    with pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(chart.merge_values(values))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": {"source": {"type": "pvc"}}}, "model.source.pvc.claimName is required"),
        ({"model": {"source": {"type": "hostPath"}}}, "model.source.hostPath.path is required"),
        ({"model": {"source": {"type": "initContainer"}}}, "model.source.initContainer.args is required"),
    ],
)
def test_incomplete_model_sources_fail_with_the_field_to_set(chart, values, message):
    with pytest.raises(helm.HelmRenderError, match=message):
        chart.render(values, name="demo")


# ---------------------------------------------------------------------------- rendered manifests


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_manifests_validate_against_kubernetes_schemas(chart, scenario):
    docs = render(chart, SCENARIOS[scenario])
    for name, manifests in docs.items():
        for manifest in manifests:
            if manifest["kind"] == "ServiceMonitor":  # a CRD: checked by hand below
                continue
            for version in KUBE_VERSIONS:
                try:
                    kubernetes_validate.validate(manifest, version, strict=True)
                except kubernetes_validate.ValidationError as err:
                    pytest.fail(f"{name} ({version}): {err.message} at {list(err.path)}")


def test_kubernetes_validation_really_checks(chart):
    deployment = one(render(chart), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[0], strict=True)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_operator_config_passes_the_server_validation(chart, scenario):
    data = rendered_operator_config(render(chart, SCENARIOS[scenario]))
    jsonschema.Draft7Validator(OperatorConfig.json_schema()).validate(data)
    config = OperatorConfig.validate_mapping(data, source="configmap")
    expected = SCENARIOS[scenario].get("compression", {}).get("default", {"policy": "full"})
    assert config.resolve(None).policy == expected["policy"]


@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_preset_round_trips_through_the_chart(chart, preset):
    data = yaml.safe_load((CONFIGS / preset).read_text())
    chart.validate_schema(chart.merge_values({"compression": data}))
    rendered = rendered_operator_config(render(chart, {"compression": data}))
    via_chart = OperatorConfig.validate_mapping(rendered)
    direct = OperatorConfig.load(CONFIGS / preset)
    assert via_chart.resolve(None) == direct.resolve(None)
    assert via_chart.usable_policies() == direct.usable_policies()


def test_deployment_passes_and_mounts_the_operator_config(chart):
    docs = render(chart)
    container = server(docs)
    assert container["command"] == ["vllm-kvcomp", "serve"]
    args = container["args"]
    assert args[0] == "/models/model"
    assert args[args.index("--kv-compression-config") + 1] == CONFIG_PATH
    assert args[args.index("--port") + 1] == "8000"
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "kv-compression-config")
    assert mount["mountPath"] + "/kv-compression.yaml" == CONFIG_PATH and mount["readOnly"]
    assert volumes["kv-compression-config"]["configMap"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"


def test_config_changes_roll_the_pods(chart):
    def checksum(values):
        return one(render(chart, values), "Deployment")["spec"]["template"]["metadata"]["annotations"][
            "checksum/kv-compression-config"
        ]

    assert checksum({}) != checksum({"compression": {"default": {"policy": "lagkv"}}})


def test_probes_hit_health_on_the_served_port(chart):
    container = server(render(chart, {"server": {"port": 9000}}))
    assert container["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 600


def test_gpu_resources_node_selection_and_tolerations(chart):
    docs = render(chart, {"gpu": {"count": 4}, "nodeSelector": {"pool": "h100"}})
    assert server(docs)["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 4}
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "h100"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    cpu = render(chart, SCENARIOS["cpu"])
    assert "nvidia.com/gpu" not in server(cpu)["resources"]["limits"]
    assert "tolerations" not in one(cpu, "Deployment")["spec"]["template"]["spec"]


def test_pods_run_as_non_root(chart):
    pod = one(render(chart), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert server(render(chart))["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize(
    ("scenario", "volume"),
    [
        ("pvc", {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}),
        ("hostPath", {"hostPath": {"path": "/mnt/models", "type": "Directory"}}),
        ("initContainer", {"emptyDir": {"sizeLimit": "100Gi"}}),
    ],
)
def test_model_sources(chart, scenario, volume):
    docs = render(chart, SCENARIOS[scenario])
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (model,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert {k: v for k, v in model.items() if k != "name"} == volume
    mount = next(m for m in server(docs)["volumeMounts"] if m["name"] == "model")
    assert mount["mountPath"] == "/models"
    if scenario == "pvc":
        assert mount["subPath"] == "llama" and server(docs)["args"][0] == "/models/llama"
    if scenario == "initContainer":
        (init,) = pod["initContainers"]
        assert init["args"][0] == "Qwen/Qwen2.5-7B-Instruct" and init["command"] == ["hf", "download"]
        assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
        assert any(e["name"] == "HF_TOKEN" for e in init["env"])
    no_model = one(render(chart), "Deployment")["spec"]["template"]["spec"]
    assert "model" not in {v["name"] for v in no_model["volumes"]}


def test_everything_scenario_wires_optional_parts(chart):
    docs = render(chart, SCENARIOS["everything"])
    args = server(docs)["args"]
    assert args[0] == "Qwen/Qwen2.5-7B-Instruct"
    assert args[args.index("--served-model-name") + 1] == "qwen"
    assert args[-3:] == ["--max-model-len", "32768", "--enforce-eager"]
    env = {e["name"]: e for e in server(docs)["env"]}
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "api", "key": "api-key"}
    assert env["VLLM_LOGGING_LEVEL"]["value"] == "DEBUG"
    assert "replicas" not in one(docs, "Deployment")["spec"]  # the HPA owns it
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert "ServiceMonitor" not in {d["kind"] for ds in render(chart).values() for d in ds}
    assert "HorizontalPodAutoscaler" not in {d["kind"] for ds in render(chart).values() for d in ds}


def test_service_selects_the_server_pods(chart):
    docs = render(chart)
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_helm_test_pod_checks_health_and_models(chart):
    docs = render(chart, {"server": {"apiKeySecret": {"name": "api"}}})
    pod = docs["tests/test-connection.yaml"][0]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["args"][0]
    service = one(docs, "Service")
    assert f'base="http://{service["metadata"]["name"]}:{service["spec"]["ports"][0]["port"]}"' in script
    assert '"$base/health"' in script and '"$base/v1/models"' in script
    assert pod["spec"]["containers"][0]["env"][0]["name"] == "API_KEY"


def test_notes_explain_access(chart):
    notes = chart.render({}, name="demo", namespace="ml")["vllm-kvcomp/templates/NOTES.txt"]
    assert "port-forward service/demo-vllm-kvcomp 8000:8000" in notes
    assert "X-KV-Compression: policy=lagkv; ratio=0.25" in notes
    assert "helm test demo -n ml" in notes
