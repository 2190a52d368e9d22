"""The launch files in cluster/launch/ as far as they can be checked without a cluster: the
`ray up` file against Ray's own schema; the KubeRay manifest's config and entry point against
staleflow's parser, its ConfigMap and pod templates against Kubernetes' own schemas (strict:
an unknown field fails), and the RayJob against KubeRay's CRD when one is given in
$KUBERAY_CRD (it is not vendored here); the SLURM script with bash (shellcheck runs in
`make lint`)."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
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

    # `ray job stop` (and deleting the RayJob, through it) SIGKILLs the driver
    # RAY_JOB_STOP_WAIT_TIME_S after its SIGTERM, 3 s unless the job's runtime env says more
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) >= 600


def test_ray_up_job_submission_gives_the_clean_stop_its_time():
    for text in ((LAUNCH / "ray-up.yaml").read_text(), (REPO / "README.md").read_text()):
        submit = text[text.index("ray job submit --address") :].split("staleflow train")[0]
        assert '"RAY_JOB_STOP_WAIT_TIME_S": "600"' in submit


def test_slurm_script_is_valid_bash_and_trains_the_given_config():
    script = LAUNCH / "slurm.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "#SBATCH --gpus-per-node" in text
    assert 'staleflow train "$CONFIG" "$@" --address' in text


# Stand-ins for what a SLURM allocation provides, to drive the script's own logic (which node
# is the head, waiting for the nodes, handing a stop signal to the driver): SLURM's commands,
# `ray start` (a process that stays up, as `--block` does, and counts itself as a node) and
# the driver (records its arguments and the signals it gets).
_STUBS = {
    "scontrol": 'printf "%s\\n" node1 node2\n',
    "srun": 'while [[ "$1" == -* ]]; do [[ "$1" == -w ]] && shift; shift; done\nexec "$@"\n',
    # --ip-address: the name as resolved; -I: every interface's address
    "hostname": (
        'if [[ "$1" == -I ]]; then echo "$HEAD_ADDRESSES"; else echo "$HEAD_RESOLVED"; fi\n'
    ),
    "ray": (
        'if [[ "$1 $2" == "start --address"* && -n "${WORKER_FAILS:-}" ]]; then exit 1; fi\n'
        'if [[ "$1 $2" == "start --address"* && -n "${WORKER_LOST:-}" ]]; then exec sleep 600; fi\n'
        'if [[ "$1" == start ]]; then echo up >> "$STATE/nodes"; exec sleep 600; fi\n'
    ),
    "python": 'cat "$STATE/nodes" 2>/dev/null | wc -l\n',
    "staleflow": (
        'echo "$*" > "$STATE/driver"\n'
        "trap 'echo TERM >> \"$STATE/driver\"; sleep 0.5; exit 143' TERM\n"
        "while true; do sleep 0.1; done\n"
    ),
}


def _slurm_script(
    tmp_path: Path, args: tuple[str, ...] = ("c.yaml", "run.steps=5"), **env: str
) -> tuple[subprocess.Popen[bytes], Path]:
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, body in _STUBS.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    environ = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}", "STATE": str(state),
        "SLURM_JOB_NODELIST": "node[1-2]", "HEAD_RESOLVED": "10.0.0.1",
        "HEAD_ADDRESSES": "172.17.0.1 10.0.0.1", **env,
    }  # fmt: skip
    # output to a file: the `ray start` stand-ins outlive the script (as SLURM's steps do
    # until the job ends) and would hold a pipe open
    with (state / "out.log").open("w") as out:
        proc = subprocess.Popen(
            ["bash", str(LAUNCH / "slurm.sh"), *args], cwd=tmp_path,
            env=environ, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # its `ray start` stand-ins are killed with the group
        )  # fmt: skip
    return proc, state


def _finish(proc: subprocess.Popen[bytes], state: Path) -> str:
    """Wait for the script (60 s at most), kill what it left, return its output."""
    try:
        proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return (state / "out.log").read_text()


def test_slurm_script_hands_a_stop_signal_to_the_driver_and_exits_with_its_status(tmp_path):
    # `scancel --batch --signal=TERM` and `--signal=B:TERM@300` signal the script alone. It
    # ran the driver in the foreground, so bash would have run no trap until the driver ended.
    proc, state = _slurm_script(tmp_path)
    driver = state / "driver"
    deadline = time.monotonic() + 60
    while not driver.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert driver.exists(), _finish(proc, state)
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc, state)
    assert proc.returncode == 143, out
    assert driver.read_text().splitlines() == [
        "train c.yaml run.steps=5 --address 10.0.0.1:6379",  # the head's name, resolved
        "TERM",
    ]
    assert "SIGTERM to the driver" in out


def test_slurm_script_resumes_a_run_its_header_says_it_can(tmp_path):
    # `sbatch slurm.sh --resume runs/NAME` ran `train --resume --address H:P runs/NAME`,
    # which argparse refuses (--resume took no value): the resume the header promises
    from staleflow.cluster.cli import build_parser

    proc, state = _slurm_script(tmp_path, args=("--resume", "runs/r", "run.steps=9"))
    deadline = time.monotonic() + 60
    while not (state / "driver").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _finish(proc, state)
    argv = (state / "driver").read_text().splitlines()[0].split()
    assert argv == ["train", "--resume", "runs/r", "run.steps=9", "--address", "10.0.0.1:6379"]
    args = build_parser().parse_args(argv)  # what the real staleflow makes of it (the
    # first override lands in `config`, which a resume takes as one: _resumed_config)
    assert (args.resume, args.config, args.address) == ("runs/r", "run.steps=9",
                                                        "10.0.0.1:6379")  # fmt: skip


def test_slurm_script_takes_an_interface_address_when_the_head_s_name_is_loopback(tmp_path):
    # many hosts map their own name to 127.0.1.1: the other nodes would dial themselves
    proc, state = _slurm_script(tmp_path, HEAD_RESOLVED="127.0.1.1")
    deadline = time.monotonic() + 60
    while not (state / "driver").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _finish(proc, state)
    assert "--address 172.17.0.1:6379" in (state / "driver").read_text()


@pytest.mark.parametrize(
    ("env", "error"),
    [
        (
            {"HEAD_RESOLVED": "127.0.1.1", "HEAD_ADDRESSES": ""},
            "no routable address on the head node node1",
        ),
        ({"WORKER_FAILS": "1"}, "a 'ray start' step exited"),
        ({"WORKER_LOST": "1", "RAY_START_TIMEOUT_S": "1"}, "1 of 2 Ray node(s) up after 1 s"),
    ],
    ids=["loopback-head", "worker-start-fails", "worker-never-joins"],
)
def test_slurm_script_refuses_to_start_the_driver_on_a_cluster_that_did_not_form(
    tmp_path, env, error
):
    # It slept 10 s and started the driver whatever had come up.
    proc, state = _slurm_script(tmp_path, **env)
    out = _finish(proc, state)
    assert proc.returncode == 1, out
    assert f"error: {error}" in out
    assert not (state / "driver").exists()


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


def test_image_build_refuses_pip_urls_with_credentials_before_building(tmp_path):
    # docker/build.sh passes the host's pip index URLs as build args, which the image's
    # history keeps: a token in one would be published with the image
    (tmp_path / "pip").mkdir()  # the user's pip.conf ($XDG_CONFIG_HOME/pip/pip.conf)
    conf = tmp_path / "pip" / "pip.conf"
    conf.write_text("[global]\nextra-index-url = https://ci:s3cret@pypi.example/simple\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("apt-get", "podman", "sudo", "debootstrap"):  # nothing may be installed or run
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} ran >&2\nexit 97\n")
        (bin_dir / tool).chmod(0o755)
    env = {
        **os.environ,
        "XDG_CONFIG_HOME": str(tmp_path),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
    }
    out = subprocess.run(
        ["bash", str(REPO / "docker" / "build.sh")], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "holds credentials (user@ or user:token@)" in out.stderr
    assert " ran" not in out.stderr
