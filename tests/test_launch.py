"""The launch files in cluster/launch/ as far as they can be checked without a cluster: the
`ray up` file against Ray's own schema, the KubeRay manifest's config and entry point against
staleflow's parser, the SLURM script with bash (shellcheck runs in `make lint`)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

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
