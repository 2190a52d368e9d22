"""The launch files in cluster/launch/ as far as they can be checked without a cluster: the
`ray up` file against Ray's own schema; the KubeRay manifest's config and entry point against
staleflow's parser, its ConfigMap and pod templates against Kubernetes' own schemas (strict:
an unknown field fails), and the RayJob against KubeRay's CRD when one is given in
$KUBERAY_CRD (it is not vendored here); the SLURM script with bash (shellcheck runs in
`make lint`)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from staleflow.cluster.cli import parse
from staleflow.cluster.schedule import check_schedule
from staleflow.configs import load_config, parse_config

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "cluster" / "launch"


def test_ray_up_file_passes_rays_validator():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((LAUNCH / "ray-up.yaml").read_text())
    validate_config(prepare_config(config))  # raises jsonschema.ValidationError
    assert "--gpus all" in config["docker"]["run_options"]
    assert any(o.startswith("--shm-size") for o in config["docker"]["run_options"])


def test_rayjob_runs_the_configmap_config_which_is_the_gpu_quickstart():
    configmap, rayjob = yaml.safe_load_all((LAUNCH / "rayjob.yaml").read_text())
    assert (configmap["kind"], rayjob["kind"]) == ("ConfigMap", "RayJob")
    assert rayjob["apiVersion"] == "ray.io/v1"
    spec = rayjob["spec"]
    assert spec["rayClusterSpec"]["rayVersion"] == ray.__version__  # the pinned Ray

    # The entry point parses, and its config is the ConfigMap mounted on the head pod.
    args = parse(shlex.split(spec["entrypoint"])[1:])
    assert (args.command, args.address) == ("train", "auto")
    pod = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    config_path = Path(args.config)
    assert str(config_path.parent) == mount["mountPath"]
    text = configmap["data"][config_path.name]

    # It loads, passes the schedule checks, and is configs/quickstart-gpu.yaml but for where
    # the run directory goes (a volume of the head pod).
    cfg = parse_config(text)
    check_schedule(cfg)
    assert cfg.run.output_dir == "/mnt/runs"
    assert any(m["mountPath"] == cfg.run.output_dir for m in pod["containers"][0]["volumeMounts"])
    quickstart = load_config(REPO / "configs" / "quickstart-gpu.yaml", ["run.output_dir=/mnt/runs"])
    assert cfg.model_dump() == quickstart.model_dump()


def test_slurm_script_is_valid_bash_and_trains_the_given_config():
    script = LAUNCH / "slurm.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "#SBATCH --gpus-per-node" in text
    assert 'staleflow train "$CONFIG" --address' in text


KUBERNETES = "1.33.0"  # the oldest Kubernetes the manifest is checked against


def _pod_templates(rayjob: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    return [group["template"] for group in groups]


def test_rayjob_configmap_and_pod_templates_pass_kubernetes_schemas():
    import kubernetes_validate

    configmap, rayjob = yaml.safe_load_all((LAUNCH / "rayjob.yaml").read_text())
    kubernetes_validate.validate(configmap, KUBERNETES, strict=True)
    for i, template in enumerate(_pod_templates(rayjob)):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pod-{i}"}, **template}
        kubernetes_validate.validate(pod, KUBERNETES, strict=True)  # raises ValidationError

    # the check is strict: a misspelt field in a pod template fails it
    broken = _pod_templates(rayjob)[0]
    broken["spec"]["containers"][0]["volumeMount"] = broken["spec"]["containers"][0].pop(
        "volumeMounts"
    )
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "broken"}, **broken}
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(pod, KUBERNETES, strict=True)


def _unknown_fields(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the API server would prune (absent from a structural schema's properties)."""
    if isinstance(value, list) and "items" in schema:
        items = schema["items"]
        return [u for i, v in enumerate(value) for u in _unknown_fields(v, items, f"{path}[{i}]")]
    if not isinstance(value, dict) or "properties" not in schema:
        return []
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    for key, item in value.items():
        if key in schema["properties"]:
            found += _unknown_fields(item, schema["properties"][key], f"{path}.{key}")
        else:
            found.append(f"{path}.{key}")
    return found


@pytest.mark.skipif(
    not os.environ.get("KUBERAY_CRD"),
    reason="set KUBERAY_CRD to KubeRay's ray-operator/config/crd/bases/ray.io_rayjobs.yaml",
)
def test_rayjob_matches_the_kuberay_crd():
    import jsonschema

    crd = yaml.safe_load(Path(os.environ["KUBERAY_CRD"]).read_text())
    assert crd["spec"]["names"]["kind"] == "RayJob"
    _, rayjob = yaml.safe_load_all((LAUNCH / "rayjob.yaml").read_text())
    group, version = rayjob["apiVersion"].split("/")
    assert group == crd["spec"]["group"]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = served["schema"]["openAPIV3Schema"]
    errors = [f"{list(e.path)}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(rayjob)]  # fmt: skip
    assert errors == []
    assert _unknown_fields(rayjob, schema) == []
