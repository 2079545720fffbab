"""Offline checks for the Kubernetes manifests in k8s/ (used by tests/test_k8s.py and
tests/test_k8s_crd.py).

* `strict_schema` turns the vendored KubeRay RayService CRD's openAPIV3Schema into a JSON schema
  that rejects unknown fields, as `kubectl apply --validate=strict` (server-side field validation)
  does: the CRD never says `additionalProperties: false`, so it is added wherever `properties` is
  given and neither `additionalProperties` nor `x-kubernetes-preserve-unknown-fields` is. String
  maps such as `rayStartParams` (`additionalProperties: {type: string}`) stay open.
* `validator` adds what the API server checks beyond plain JSON schema: int32/int64 ranges and
  uniqueness of `x-kubernetes-list-type: map|set` lists (ports, env, ...).
* `kuberay_errors` re-states the KubeRay v1.7.0 admission rules (utils/validation.go) that
  manifests like ours can break.
* The rest reads the manifests, pyproject.toml, the Dockerfile and the app built from
  `deploy.app:specextend`.
"""

from __future__ import annotations

import copy
import functools
import importlib
import math
import re
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List

import jsonschema
import yaml
from jsonschema import ValidationError
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
CRD_PATH = K8S / "crd" / "ray.io_rayservices.yaml"
MANIFESTS = {"gpu": K8S / "rayservice.yaml", "cpu": K8S / "rayservice-cpu.yaml"}
DOCKERFILE = K8S / "Dockerfile"

MAX_RAYSERVICE_NAME = 47  # KubeRay MaxRayServiceNameLength (53 - 6)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_PORT_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")  # IANA_SVC_NAME, with length <= 15
UPGRADE_TYPES = ("NewCluster", "NewClusterWithIncrementalUpgrade", "None")


def load_docs(path: Path) -> List[Dict[str, Any]]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def rayservice(path: Path) -> Dict[str, Any]:
    """The single RayService document of a manifest file."""
    docs = [d for d in load_docs(path) if d.get("kind") == "RayService"]
    assert len(docs) == 1, f"{path.name}: expected exactly one RayService, found {len(docs)}"
    return docs[0]


@functools.lru_cache(maxsize=None)
def _crd_text(path: Path) -> Dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path) as f:
        return yaml.load(f, Loader=loader)


def load_crd(path: Path = CRD_PATH) -> Dict[str, Any]:
    """The CRD as a fresh dict (parsed once per process)."""
    return copy.deepcopy(_crd_text(path))


def crd_version(crd: Dict[str, Any], name: str = "v1") -> Dict[str, Any]:
    for version in crd["spec"]["versions"]:
        if version["name"] == name:
            return version
    raise KeyError(f"CRD has no version {name!r}")


def strict_schema(schema: Dict[str, Any]) -> Dict[str, Any]:
    """A deep copy of `schema` in which every object with `properties` forbids unknown fields."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for child in node.get("properties", {}).values():
            walk(child)
        for key in ("items", "additionalProperties", "not"):
            if isinstance(node.get(key), (dict, list)):
                walk(node[key])
        for key in ("allOf", "anyOf", "oneOf"):
            walk(node.get(key, []))

    walk(schema)
    return schema


def _list_map_keys(validator, keys, instance, schema) -> Iterator[ValidationError]:
    """`x-kubernetes-list-map-keys`: items must be unique by these keys (defaults applied)."""
    if not isinstance(instance, list):
        return
    props = schema.get("items", {}).get("properties", {})
    seen = set()
    for item in instance:
        if not isinstance(item, dict):
            continue
        key = tuple(item.get(k, props.get(k, {}).get("default")) for k in keys)
        if key in seen:
            yield ValidationError(f"duplicate entry for list-map keys {keys}: {key}")
        seen.add(key)


def _list_type(validator, list_type, instance, schema) -> Iterator[ValidationError]:
    if list_type == "set" and isinstance(instance, list):
        items = [yaml.safe_dump(i, sort_keys=True) for i in instance]
        if len(set(items)) != len(items):
            yield ValidationError("duplicate entries in a list-type=set list")


_FORMATS = jsonschema.FormatChecker()


@_FORMATS.checks("int32")
def _is_int32(value: Any) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _is_int64(value: Any) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


_KubeValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator,
    {"x-kubernetes-list-map-keys": _list_map_keys, "x-kubernetes-list-type": _list_type},
)


def validator(crd_path: Path = CRD_PATH, strict: bool = True):
    """A jsonschema validator for RayService objects, strict about unknown fields by default."""
    schema = crd_version(_crd_text(crd_path))["schema"]["openAPIV3Schema"]
    return _KubeValidator(strict_schema(schema) if strict else schema, format_checker=_FORMATS)


def schema_errors(doc: Dict[str, Any], v=None) -> List[str]:
    v = v or validator()
    return sorted(f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
                  for e in v.iter_errors(doc))


def metadata_errors(doc: Dict[str, Any]) -> List[str]:
    """apiVersion/kind and the ObjectMeta rules the CRD schema leaves to the API server."""
    errors = []
    if doc.get("apiVersion") != "ray.io/v1":
        errors.append(f"apiVersion must be ray.io/v1, got {doc.get('apiVersion')!r}")
    if doc.get("kind") != "RayService":
        errors.append(f"kind must be RayService, got {doc.get('kind')!r}")
    meta = doc.get("metadata") or {}
    unknown = set(meta) - {"name", "namespace", "labels", "annotations"}
    if unknown:
        errors.append(f"unexpected metadata fields {sorted(unknown)}")
    name = meta.get("name", "")
    if not _DNS1035.match(name) or len(name) > MAX_RAYSERVICE_NAME:
        errors.append(f"metadata.name {name!r} must be a DNS-1035 label of at most "
                      f"{MAX_RAYSERVICE_NAME} characters")
    if "namespace" in meta and not _DNS1123.match(str(meta["namespace"])):
        errors.append(f"metadata.namespace {meta['namespace']!r} is not a valid name")
    for field in ("labels", "annotations"):
        for key, value in (meta.get(field) or {}).items():
            if not isinstance(value, str):
                errors.append(f"metadata.{field}.{key} must be a string")
            elif field == "labels" and (len(value) > 63 or not _LABEL_VALUE.match(value)):
                errors.append(f"metadata.labels.{key}: invalid label value {value!r}")
            if len(key.split("/")[-1]) > 63 or not _LABEL_NAME.match(key.split("/")[-1]):
                errors.append(f"metadata.{field}: invalid key {key!r}")
    return errors


def groups(cluster: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Head group first, then the worker groups."""
    return [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]


def ray_container(group: Dict[str, Any]) -> Dict[str, Any]:
    return group["template"]["spec"]["containers"][0]  # KubeRay's RayContainerIndex


def kuberay_errors(doc: Dict[str, Any]) -> List[str]:
    """The KubeRay v1.7.0 admission rules (ValidateRayServiceSpec) relevant to these manifests."""
    errors = []
    spec = doc["spec"]
    cluster = spec["rayClusterConfig"]
    auth = cluster.get("authOptions") or {}
    if auth.get("mode", "token" if auth else "disabled") == "token":
        version = tuple(int(x) for x in str(cluster.get("rayVersion", "0")).split(".")[:3])
        if version < (2, 52, 0):
            errors.append("authOptions.mode token needs rayVersion >= 2.52.0")
    if auth.get("enableK8sTokenAuth"):
        errors.append("authOptions.enableK8sTokenAuth is not supported for RayService")
    if "upgradeStrategy" in cluster:
        errors.append("rayClusterConfig.upgradeStrategy cannot be set in a RayService")
    if ((spec.get("upgradeStrategy") or {}).get("type", "NewCluster")) not in UPGRADE_TYPES:
        errors.append(f"spec.upgradeStrategy.type must be one of {UPGRADE_TYPES}")
    if (cluster["headGroupSpec"].get("headService") or {}).get("metadata", {}).get("name"):
        errors.append("headService.metadata.name must not be set for a RayService")
    autoscaling = bool(cluster.get("enableInTreeAutoscaling"))
    for group in groups(cluster):
        gname = group.get("groupName", "head")
        if not group["template"]["spec"].get("containers"):
            errors.append(f"{gname}: needs at least one container")
        params = group.get("rayStartParams") or {}
        if "labels" in params:
            errors.append(f"{gname}: use the top-level labels field, not rayStartParams.labels")
        if group.get("resources") and ({"resources", "num-cpus", "num-gpus", "memory"} & set(params)):
            errors.append(f"{gname}: resources set in both rayStartParams and resources")
        if group is cluster["headGroupSpec"]:
            continue
        lo, hi = group.get("minReplicas"), group.get("maxReplicas")
        if not autoscaling and (lo is None or hi is None):
            errors.append(f"{gname}: minReplicas and maxReplicas are required")
        if lo is not None and hi is not None and not lo <= group.get("replicas", lo) <= hi:
            errors.append(f"{gname}: need minReplicas <= replicas <= maxReplicas")
        if autoscaling and group.get("suspend"):
            errors.append(f"{gname}: cannot be suspended with the autoscaler enabled")
    return errors


def port_errors(container: Dict[str, Any]) -> List[str]:
    errors, names = [], set()
    for port in container.get("ports", []):
        name = port.get("name", "")
        if len(name) > 15 or not _PORT_NAME.match(name) or "--" in name or name.isdigit():
            errors.append(f"{container['name']}: port name {name!r} is not an IANA_SVC_NAME")
        if name in names:
            errors.append(f"{container['name']}: duplicate port name {name!r}")
        names.add(name)
    return errors


def serve_unknown_keys(model: Any, data: Any, path: str = "") -> List[str]:
    """Keys in `data` that pydantic model `model` would silently ignore (Ray's Serve schemas do)."""
    import typing

    from pydantic import BaseModel

    def models_in(annotation: Any) -> List[type]:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [annotation]
        return [m for arg in typing.get_args(annotation) for m in models_in(arg)]

    if not isinstance(data, dict):
        return []
    unknown = [f"{path}{k}" for k in data if k not in model.model_fields]
    for key, value in data.items():
        field = model.model_fields.get(key)
        sub = models_in(field.annotation) if field is not None else []
        if len(sub) != 1:
            continue
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            unknown += serve_unknown_keys(sub[0], item, f"{path}{key}[{i}].")
    return unknown


# ---------------------------------------------------------------- manifests, app, image

def load(name: str) -> Dict[str, Any]:
    """The RayService of manifest `name` (`gpu` or `cpu`)."""
    return rayservice(MANIFESTS[name])


def serve_config(doc):
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


def the_app(doc):
    apps = serve_config(doc)["applications"]
    assert len(apps) == 1
    return apps[0]


def pyproject():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip install tomli
        import tomli as tomllib
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def ray_pin():
    for dep in pyproject()["dependencies"]:
        req = Requirement(dep)
        if req.name == "ray":
            (spec,) = req.specifier
            assert spec.operator == "==", f"ray must be pinned exactly, got {dep}"
            return spec.version
    raise AssertionError("pyproject.toml does not depend on ray")


def gpus(container):
    res = container.get("resources", {})
    return int(res.get("limits", {}).get("nvidia.com/gpu", 0))


def workers(doc):
    return doc["spec"]["rayClusterConfig"].get("workerGroupSpecs", [])


def serve_replicas(doc, deployment=None, default=1):
    """Most replicas the manifest lets a deployment run at once, rolling-update surge included
    (`default` when serveConfigV2 does not override the deployment)."""
    counts = []
    for d in the_app(doc).get("deployments", []):
        if deployment is None or d["name"] == deployment:
            scaling = d.get("autoscaling_config") or {}
            n = scaling.get("max_replicas", d.get("num_replicas", default))
            n = n if isinstance(n, int) else default  # `auto` without max_replicas
            counts.append(n + math.ceil(n * d.get("max_surge_percent", 0) / 100))
    return max(counts, default=default)


def import_builder():
    """The object serveConfigV2's import_path names (deploy/app.py must exist)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    module, _, attr = the_app(load("gpu"))["import_path"].partition(":")
    return getattr(importlib.import_module(module), attr)


def build(args):
    """The app's deployments, built as Serve's build task does: builder(args), then build_app."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app

    app = call_user_app_builder_with_args_if_necessary(import_builder(), dict(args))
    return build_app(app, name="specextend").deployments


def replica_resources(deployment):
    """(CPUs, GPUs) one replica reserves: its placement group's bundles, else its actor options."""
    bundles = deployment._replica_config.placement_group_bundles
    if bundles:
        return (sum(b.get("CPU", 0) for b in bundles), sum(b.get("GPU", 0) for b in bundles))
    opts = deployment.ray_actor_options or {}
    return opts.get("num_cpus", 1), opts.get("num_gpus", 0)


def code_replicas(deployment):
    """Most replicas the app's code gives a deployment (1 when it sets nothing)."""
    scaling = deployment._deployment_config.autoscaling_config
    if scaling is not None:
        return scaling.max_replicas
    return deployment.num_replicas if isinstance(deployment.num_replicas, int) else 1


def dockerfile_base():
    """The Dockerfile's default base image (FROM ${BASE_IMAGE})."""
    text = DOCKERFILE.read_text()
    (default,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    (frm,) = re.findall(r"^FROM (\S+)", text, re.M)
    assert frm == "${BASE_IMAGE}"
    return default


def ray_image_tags(text):
    """(ray version, python major, python minor, flavor) of every rayproject/ray tag in text."""
    return re.findall(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)(-gpu|-cu\d+)?\b", text)
