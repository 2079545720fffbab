"""k8s/: the RayService manifests, the image and the docs agree with Ray and the project.

Offline: the cluster's shape, serveConfigV2 through Ray's own Serve schema and the same builder
call `serve` makes (deploy/app.py), the image and the walkthrough. The manifests against the
vendored KubeRay CRD: test_k8s_crd.py.
"""

from __future__ import annotations

import ast
import copy
import inspect
import re
import sys
import types
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet

sys.path.insert(0, str(Path(__file__).resolve().parent))
import k8s_schema as ks  # noqa: E402

# Ray's own Serve config models emit pydantic deprecation warnings on import; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")

APP_ARGS = {"target", "draft", "mode", "num_gpus", "tree_nodes", "tree_depth", "tree_topk",
            "retrieval_chunk_size", "retrieval_top_k", "retrieval_every", "max_prompt_tokens",
            "max_new_tokens", "max_concurrent_sessions", "dtype", "attention_backend"}
EXPECTED_ARGS = {
    "gpu": {"target": "default", "draft": "default", "mode": "specextend", "num_gpus": 1,
            "dtype": "bfloat16"},
    "cpu": {"target": "random:llama-tiny", "draft": "random:llama-tiny-draft", "num_gpus": 0},
}
HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000,
              "metrics": 8080}
WORKER_PORTS = {"serve": 8000, "metrics": 8080}
DOCKERFILE = ks.DOCKERFILE
README = ks.K8S / "README.md"
NAMES = sorted(ks.MANIFESTS)


# ---------------------------------------------------------------- cluster shape

@pytest.mark.parametrize("name", NAMES)
def test_head_runs_no_model_work(name):
    cluster = ks.load(name)["spec"]["rayClusterConfig"]
    params = cluster["headGroupSpec"]["rayStartParams"]
    assert params.get("num-cpus") == "0" and params.get("num-gpus") == "0"
    assert ks.gpus(ks.ray_container(cluster["headGroupSpec"])) == 0
    assert ks.load(name)["spec"].get("excludeHeadPodFromServeSvc") is True


@pytest.mark.parametrize("name", NAMES)
def test_named_ports(name):
    cluster = ks.load(name)["spec"]["rayClusterConfig"]
    for group in ks.groups(cluster):
        want = HEAD_PORTS if group is cluster["headGroupSpec"] else WORKER_PORTS
        ctr = ks.ray_container(group)
        assert ks.port_errors(ctr) == []
        have = {p["name"]: p["containerPort"] for p in ctr["ports"]}
        assert {k: have.get(k) for k in want} == want


@pytest.mark.parametrize("name", NAMES)
def test_readiness_reflects_the_app(name):
    cluster = ks.load(name)["spec"]["rayClusterConfig"]
    # The head keeps KubeRay's probes: the operator deploys the app only once the head is ready.
    assert "readinessProbe" not in ks.ray_container(cluster["headGroupSpec"])
    for group in ks.workers(ks.load(name)):
        probe = ks.ray_container(group)["readinessProbe"]
        command = " ".join(probe["exec"]["command"])
        for check in ("localhost:52365/api/local_raylet_healthz", "localhost:8000/-/healthz",
                      "localhost:8000/health"):
            assert check in command


@pytest.mark.parametrize("name", NAMES)
def test_token_auth_from_secret(name):
    cluster = ks.load(name)["spec"]["rayClusterConfig"]
    auth = cluster["authOptions"]
    assert auth["mode"] == "token" and auth["secretName"]
    for group in ks.groups(cluster):
        for env in ks.ray_container(group).get("env", []):
            assert env["name"] not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"), "KubeRay sets these"
    readme = README.read_text()
    assert re.search(rf"kubectl create secret generic {auth['secretName']}\b.*auth_token=",
                     readme.replace("\\\n", " "))


API_KEY_ENV = "SPECEXTEND_API_KEY"  # serving/auth.py's ENV


@pytest.mark.parametrize("name", NAMES)
def test_every_pod_and_container_is_locked_down(name):
    """Pods: non-root as the image's user, RuntimeDefault seccomp; containers (and the autoscaler
    sidecar): no privilege escalation, no capabilities."""
    (user, group), = re.findall(r"^USER (\d+):(\d+)$", DOCKERFILE.read_text(), re.M)
    assert DOCKERFILE.read_text().rstrip().splitlines()[-1] == f"USER {user}:{group}", "the image ends as it"
    cluster = ks.load(name)["spec"]["rayClusterConfig"]
    for group_spec in ks.groups(cluster):
        pod = group_spec["template"]["spec"]
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["seccompProfile"] == {"type": "RuntimeDefault"}
        assert (ctx["runAsUser"], ctx["runAsGroup"]) == (int(user), int(group))
        for ctr in pod["containers"] + pod.get("initContainers", []):
            sc = ctr["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
            assert sc.get("privileged") is not True and sc.get("runAsUser") in (None, int(user))
    sidecar = cluster.get("autoscalerOptions")
    if sidecar is not None:
        assert sidecar["securityContext"]["allowPrivilegeEscalation"] is False
        assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize("name", NAMES)
def test_api_key_from_a_secret_on_every_container(name):
    cluster = ks.load(name)["spec"]["rayClusterConfig"]
    refs = set()
    for group_spec in ks.groups(cluster):
        for ctr in group_spec["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in ctr.get("env", [])}
            entry = env[API_KEY_ENV]
            assert "value" not in entry, "the key comes from a Secret, never inline"
            ref = entry["valueFrom"]["secretKeyRef"]
            assert ref.get("optional") is not True, "a pod without its key must not start open"
            refs.add((ref["name"], ref["key"]))
    assert "api_key" not in ks.the_app(ks.load(name))["args"], "arguments show in the dashboard"
    (secret, key), = refs
    readme = README.read_text().replace("\\\n", " ")
    assert re.search(rf"kubectl create secret generic {secret}\b.*--from-literal={key}=", readme)
    assert "Authorization: Bearer" in readme and API_KEY_ENV in readme


def test_gpu_worker_holds_one_draft_target_pair():
    doc = ks.load("gpu")
    per_replica = 2 * ks.the_app(doc)["args"]["num_gpus"]  # target + draft, one GPU each
    assert per_replica == 2
    capacity = 0
    for group in ks.workers(doc):
        ctr = ks.ray_container(group)
        res = ctr["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
        assert res["requests"]["memory"] == res["limits"]["memory"]
        assert group["rayStartParams"]["num-gpus"] == str(ks.gpus(ctr))
        assert per_replica <= ks.gpus(ctr), "a replica's placement group is STRICT_PACK on one pod"
        capacity += group["maxReplicas"] * ks.gpus(ctr)
    assert ks.serve_replicas(doc) * per_replica <= capacity
    assert doc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


def test_cpu_manifest_has_no_gpus():
    doc = ks.load("cpu")
    assert ks.the_app(doc)["args"]["num_gpus"] == 0
    for group in ks.groups(doc["spec"]["rayClusterConfig"]):
        assert ks.gpus(ks.ray_container(group)) == 0
        assert group["rayStartParams"].get("num-gpus") == "0"
        assert "nvidia.com/gpu" not in yaml.safe_dump(group)


@pytest.mark.parametrize("name", NAMES)
def test_ray_version_matches_pyproject(name):
    assert ks.load(name)["spec"]["rayClusterConfig"]["rayVersion"] == ks.ray_pin()


# ---------------------------------------------------------------- serveConfigV2

@pytest.mark.parametrize("name", NAMES)
def test_serve_config_validates_with_ray_schema(name):
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    config = ks.serve_config(ks.load(name))
    ServeDeploySchema.model_validate(config)
    # Ray's schemas ignore unknown keys; a typo there would be dropped without a word.
    assert ks.serve_unknown_keys(ServeDeploySchema, config) == []
    app = ks.the_app(ks.load(name))
    assert app["import_path"] == "deploy.app:specextend"
    assert app.get("route_prefix", "/") == "/"
    assert config["http_options"]["port"] == 8000
    assert set(app["args"]) <= APP_ARGS
    assert {k: app["args"].get(k) for k in EXPECTED_ARGS[name]} == EXPECTED_ARGS[name]
    for deployment in app.get("deployments", []):
        if deployment.get("autoscaling_config"):
            AutoscalingConfig(**deployment["autoscaling_config"])


# ---------------------------------------------------------------- deploy/app.py

def test_import_path_is_a_serve_app_builder():
    """serveConfigV2 passes `args`, which Serve accepts only for a one-parameter builder."""
    from ray.serve import Application

    builder = ks.import_builder()
    assert isinstance(builder, (types.FunctionType, Application))
    if not isinstance(builder, Application):
        assert len(inspect.signature(builder).parameters) == 1


@pytest.mark.parametrize("name", NAMES)
def test_built_app_fits_the_worker_group(name):
    """Build exactly as Serve's build task would, on this GPU-less machine (like the head pod),
    keeping the manifest's arguments but the tiny random models (no model files needed)."""
    doc = ks.load(name)
    args = copy.deepcopy(ks.the_app(doc)["args"])
    args.update({k: EXPECTED_ARGS["cpu"][k] for k in ("target", "draft")})
    args.pop("max_prompt_tokens", None)  # sized for the real models' 32K, not the tiny ones' 8K
    deployments = ks.build(args)
    names = {d.name for d in deployments}
    overrides = {d["name"] for d in ks.the_app(doc).get("deployments", [])}
    assert overrides <= names, f"serveConfigV2 overrides unknown deployments {overrides - names}"
    pods = ks.workers(doc)
    cpu_cap = sum(g["maxReplicas"] * float(ks.ray_container(g)["resources"]["limits"]["cpu"])
                  for g in pods)
    gpu_cap = sum(g["maxReplicas"] * ks.gpus(ks.ray_container(g)) for g in pods)
    need_cpu = need_gpu = 0.0
    for d in deployments:
        cpu, gpu = ks.replica_resources(d)
        assert gpu <= max(ks.gpus(ks.ray_container(g)) for g in pods), f"{d.name} fits no pod"
        n = ks.serve_replicas(doc, d.name, default=ks.code_replicas(d))
        need_cpu, need_gpu = need_cpu + n * cpu, need_gpu + n * gpu
    if args["num_gpus"]:
        assert need_gpu == 2 * args["num_gpus"] * ks.serve_replicas(doc), "draft + target GPUs"
    assert need_gpu <= gpu_cap and need_cpu <= cpu_cap


# ---------------------------------------------------------------- image and docs

def test_dockerfile_base_image_matches_manifests_and_python():
    base = ks.dockerfile_base()
    ((ray, major, minor, flavor),) = ks.ray_image_tags(base)
    for name in NAMES:
        assert ks.load(name)["spec"]["rayClusterConfig"]["rayVersion"] == ray
    assert flavor in ("-gpu",) or flavor.startswith("-cu"), "the GPU manifest needs a CUDA image"
    assert f"{major}.{minor}" in SpecifierSet(ks.pyproject()["requires-python"])
    # Every Ray image named anywhere (CPU variant included) is the same Ray and Python.
    mentioned = [DOCKERFILE, README, *ks.MANIFESTS.values()]
    tags = [t for path in mentioned for t in ks.ray_image_tags(path.read_text())]
    assert tags and {t[:3] for t in tags} == {(ray, major, minor)}


def test_dockerfile_installs_project_and_bakes_models():
    text = DOCKERFILE.read_text()
    assert re.search(r"pip install \"torch==\$\{TORCH_VERSION\}\"", text)
    assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", text, re.M), "pin torch"
    assert re.search(r'pip install "\.\$\{extra\}" ', text)
    assert "specextend fetch-models" in text
    assert re.search(r"^ARG FETCH_MODELS=1$", text, re.M)
    # the GPU image has flash-attn-4 (the [flash] extra); the CPU variant's instructions leave it out
    assert re.search(r"^ARG WITH_FLASH=1$", text, re.M) and 'extra="[flash]"' in text
    assert "flash" in ks.pyproject()["optional-dependencies"]
    assert "--build-arg WITH_FLASH=0" in text


@pytest.mark.parametrize("name", NAMES)
def test_manifest_env_and_image_match_dockerfile(name):
    (cache,) = re.findall(r"SPECEXTEND_CACHE=(\S+)", DOCKERFILE.read_text())
    cluster = ks.load(name)["spec"]["rayClusterConfig"]
    images = set()
    for group in ks.groups(cluster):
        ctr = ks.ray_container(group)
        env = {e["name"]: e.get("value") for e in ctr.get("env", [])}
        assert env.get("SPECEXTEND_CACHE") == cache
        images.add(ctr["image"])
    assert len(images) == 1, "head and workers must run the same image"
    assert images.pop() in README.read_text()


def test_readme_walkthrough():
    text = README.read_text()
    joined = text.replace("\\\n", " ")
    for needle in ("docker build -f k8s/Dockerfile", "docker push", "helm repo add kuberay",
                   "kuberay/kuberay-operator --version 1.7.0", "kubectl apply -f k8s/rayservice.yaml",
                   "kubectl apply -f k8s/rayservice-cpu.yaml", "/v1/chat/completions",
                   "/v1/models", "from openai import OpenAI", "serveConfigV2",
                   "kind load docker-image", "minikube"):
        assert needle in joined, needle
    for name in NAMES:
        svc = ks.load(name)["metadata"]["name"] + "-serve-svc"
        assert f"svc/{svc} 8000" in joined
    blocks = re.findall(r"```(\w+)\n(.*?)```", text, re.S)
    for lang, body in blocks:
        if lang == "python":
            ast.parse(body)
        elif lang == "yaml":
            list(yaml.safe_load_all(body))
    assert any(lang == "python" for lang, _ in blocks)
