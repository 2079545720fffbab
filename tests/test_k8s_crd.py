"""k8s/: the RayService manifests against KubeRay's RayService CRD (v1.7.0, vendored in k8s/crd/),
checked strictly (unknown fields rejected), with KubeRay's own rules and Kubernetes metadata rules;
the cluster's shape and the app are in test_k8s.py.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import k8s_schema as ks  # noqa: E402

# sha256 of ray-operator/config/crd/bases/ray.io_rayservices.yaml at KubeRay tag v1.7.0
CRD_SHA256 = "0a8fc325e6e22b9231c1f282b309555e2ecf94227ca20a03df3d1d9a403907ab"
NAMES = sorted(ks.MANIFESTS)


@pytest.fixture(scope="module")
def strict():
    return ks.validator()


def test_vendored_crd_is_kuberay_v1_7_0():
    assert hashlib.sha256(ks.CRD_PATH.read_bytes()).hexdigest() == CRD_SHA256
    crd = ks.load_crd()
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == "rayservices.ray.io"
    v1 = ks.crd_version(crd, "v1")
    assert v1["served"] and v1["storage"]


@pytest.mark.parametrize("name", NAMES)
def test_manifest_validates_against_crd_strictly(name, strict):
    docs = ks.load_docs(ks.MANIFESTS[name])
    assert [d["kind"] for d in docs] == ["RayService"], "one RayService per file, no Secrets"
    doc = docs[0]
    assert ks.metadata_errors(doc) == []
    assert ks.schema_errors(doc, strict) == []
    assert ks.kuberay_errors(doc) == []


def _rename(path, old, new):
    def mutate(doc):
        node = doc
        for key in path:
            node = node[key]
        node[new] = node.pop(old)
    return mutate


def _set(path, value):
    def mutate(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


HEAD = ("spec", "rayClusterConfig", "headGroupSpec")
WORKER = ("spec", "rayClusterConfig", "workerGroupSpecs", 0)
WORKER_CTR = WORKER + ("template", "spec", "containers", 0)
TYPOS = {
    "spec.serveConfigv2": _rename(("spec",), "serveConfigV2", "serveConfigv2"),
    "rayVerison": _rename(("spec", "rayClusterConfig"), "rayVersion", "rayVerison"),
    "authOptions.secretname": _rename(("spec", "rayClusterConfig", "authOptions"),
                                      "secretName", "secretname"),
    "head container resource": _rename(HEAD + ("template", "spec", "containers", 0),
                                       "resources", "resource"),
    "minReplica": _rename(WORKER, "minReplicas", "minReplica"),
    "readinessProbe.periodSecond": _rename(WORKER_CTR + ("readinessProbe",),
                                           "periodSeconds", "periodSecond"),
    "ports containerport": _rename(WORKER_CTR + ("ports", 0), "containerPort", "containerport"),
}
BAD_VALUES = {
    "num-gpus as an integer": _set(WORKER + ("rayStartParams", "num-gpus"), 2),
    "replicas as a string": _set(WORKER + ("replicas",), "1"),
    "authOptions.mode enum": _set(("spec", "rayClusterConfig", "authOptions", "mode"), "tokens"),
    "duplicate containerPort": _set(WORKER_CTR + ("ports", 1, "containerPort"), 8000),
    "int32 overflow": _set(WORKER + ("maxReplicas",), 2**31),
    "memory quantity 32GB": _set(WORKER_CTR + ("resources", "limits", "memory"), "32GB"),
}


@pytest.mark.parametrize("case", sorted(TYPOS))
def test_misspelled_field_fails_strict_check(case, strict):
    doc = ks.load("gpu")
    TYPOS[case](doc)
    errors = ks.schema_errors(doc, strict)
    assert errors and any("Additional properties are not allowed" in e for e in errors), errors
    # Plain CRD validation (what a non-strict apply does) would silently drop the field.
    lenient = ks.schema_errors(doc, ks.validator(strict=False))
    assert not any("Additional properties" in e for e in lenient), lenient


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_wrong_value_fails_check(case, strict):
    doc = ks.load("gpu")
    BAD_VALUES[case](doc)
    assert ks.schema_errors(doc, strict)


def test_strict_check_leaves_string_maps_open(strict):
    doc = ks.load("gpu")
    ks.workers(doc)[0]["rayStartParams"]["any-ray-start-flag"] = "x"
    doc["metadata"]["labels"]["example.com/team"] = "serving"
    assert ks.schema_errors(doc, strict) == []


def test_metadata_and_kuberay_rules_catch_mistakes():
    doc = ks.load("gpu")
    doc["metadata"]["name"] = "SpecExtend_" + "x" * 50
    doc["apiVersion"] = "ray.io/v1alpha1"
    assert len(ks.metadata_errors(doc)) == 2
    doc = ks.load("gpu")
    ks.workers(doc)[0]["minReplicas"] = 9
    doc["spec"]["rayClusterConfig"]["rayVersion"] = "2.51.0"
    assert len(ks.kuberay_errors(doc)) == 2


@pytest.mark.parametrize("name", NAMES)
def test_no_deprecated_fields(name):
    crd = ks.load_crd()
    found = []

    def walk(data, schema, path):
        if isinstance(data, dict) and "properties" in schema:
            for key, value in data.items():
                sub = schema["properties"].get(key, {})
                if sub.get("description", "").startswith("Deprecated"):
                    found.append(path + key)
                walk(value, sub, path + key + ".")
        elif isinstance(data, list):
            for item in data:
                walk(item, schema.get("items", {}), path)

    walk(ks.load(name), ks.crd_version(crd)["schema"]["openAPIV3Schema"], "")
    assert found == []
