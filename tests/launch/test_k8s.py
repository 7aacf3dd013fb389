"""Kubernetes: the manifests `tfdist k8s` writes, their validation, and their pods run as local processes."""

import copy
import json
import os
import subprocess
import sys

import pytest
import yaml

from helpers import ROOT, doc_blocks, free_port_block, patient, run_tfdist, why_it_failed
import zygote

from tfdist.cluster import kubernetes
from tfdist.launch import k8s
from tfdist.config import from_dict, load_config
from tfdist.errors import ConfigError
from tfdist.launch.k8s_validation import validate

MULTI_WORKER = ("configs/default.yaml", "strategy.kind=multi_worker_mirrored")


def _write(tmp_path, config, *flags, sets=()):
    out = tmp_path / "manifests"
    args = ["k8s", "--config", config, "--image", "repo/tfdist:0.1", "--out", str(out), *(f"--set={s}" for s in sets)]
    proc = run_tfdist(*args, *flags)  # last: a command of the user's after --
    assert proc.returncode == 0, proc.stderr
    return [yaml.safe_load(open(path)) for path in proc.stdout.split()]


def _by_kind(objects):
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _containers(obj):
    """Every pod template's first container in a manifest, by role label."""
    found = {}

    def visit(node):
        if isinstance(node, dict):
            if "containers" in node.get("spec", {}) and "labels" in node.get("metadata", {}):
                found[node["metadata"]["labels"][k8s.ROLE_LABEL]] = node["spec"]["containers"][0]
            for value in node.values():
                visit(value)

    visit(obj)
    return found


def test_a_multi_worker_job_is_a_headless_service_and_an_indexed_job(tmp_path):
    objects = _by_kind(_write(tmp_path, MULTI_WORKER[0], "--workers", "3", "--gpus-per-worker", "2",
                              "--namespace", "ml", "--priority-class", "high", sets=[MULTI_WORKER[1]]))
    assert set(objects) == {("ConfigMap", "tfdist-config"), ("Service", "tfdist"), ("Job", "tfdist-worker")}
    service, job = objects["Service", "tfdist"], objects["Job", "tfdist-worker"]
    assert service["spec"]["clusterIP"] == "None" and service["metadata"]["namespace"] == "ml"
    pod = job["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 3
    assert pod["spec"]["subdomain"] == "tfdist" and pod["spec"]["priorityClassName"] == "high"
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert container["resources"]["requests"] == {"cpu": "2", "memory": "8Gi"}
    assert {"name": k8s.HOST_ENV, "value": "tfdist-{role}-{index}.tfdist"} in container["env"]
    pod_config = yaml.safe_load(objects["ConfigMap", "tfdist-config"]["data"]["config.yaml"])
    assert pod_config["cluster"]["resolver"] == "kubernetes" and pod_config["cluster"]["allow_non_loopback"]
    assert "suspend" not in job["spec"]


def test_with_a_queue_every_workload_is_labelled_and_starts_suspended(tmp_path):
    flags = ["--workers", "2", "--queue", "team-a"]
    job_set = _write(tmp_path / "a", "configs/parameter_server.yaml", *flags, "--flavor", "jobset")[-1]
    tf_job = _write(tmp_path / "b", "configs/parameter_server.yaml", *flags, "--flavor", "tfjob")[-1]
    mpi_job = _write(tmp_path / "c", "configs/horovod.yaml", *flags)[-1]
    one_role = _write(tmp_path / "d", MULTI_WORKER[0], *flags, sets=[MULTI_WORKER[1]])[-1]
    for workload in (job_set, tf_job, mpi_job, one_role):
        assert workload["metadata"]["labels"][k8s.QUEUE_LABEL] == "team-a", workload["kind"]
    assert job_set["spec"]["suspend"] and one_role["spec"]["suspend"]
    assert tf_job["spec"]["runPolicy"]["suspend"] and mpi_job["spec"]["runPolicy"]["suspend"]
    assert [r["name"] for r in job_set["spec"]["replicatedJobs"]] == ["ps", "chief", "worker"]
    assert set(tf_job["spec"]["tfReplicaSpecs"]) == {"PS", "Chief", "Worker"}


def test_horovod_is_an_mpi_job_whose_launcher_runs_horovodrun(tmp_path):
    mpi_job = _write(tmp_path, "configs/horovod.yaml", "--workers", "2", "--gpus-per-worker", "4")[-1]
    assert mpi_job["apiVersion"] == "kubeflow.org/v2beta1" and mpi_job["spec"]["slotsPerWorker"] == 4
    containers = _containers(mpi_job)
    assert containers["launcher"]["command"][:6] == ["horovodrun", "-np", "8", "--hostfile", "/etc/mpi/hostfile",
                                                     "--gloo"]
    assert containers["worker"]["command"] == ["/usr/sbin/sshd", "-De"]
    assert containers["worker"]["resources"]["limits"] == {"nvidia.com/gpu": 4}


def test_a_data_parallel_pipeline_runs_as_its_backends_job(tmp_path):
    # One pod per process: the multi-worker backend's indexed job, or Horovod's MPIJob.
    workers = _by_kind(_write(tmp_path / "a", "configs/pipeline.yaml", "--workers", "2",
                              sets=["strategy.data_parallel=multi_worker"]))
    assert set(workers) == {("ConfigMap", "tfdist-config"), ("Service", "tfdist"), ("Job", "tfdist-worker")}
    pod_config = yaml.safe_load(workers["ConfigMap", "tfdist-config"]["data"]["config.yaml"])
    assert pod_config["strategy"]["kind"] == "pipeline" and pod_config["cluster"]["resolver"] == "kubernetes"
    mpi_job = _write(tmp_path / "b", "configs/pipeline.yaml", "--workers", "2", "--gpus-per-worker", "4",
                     sets=["strategy.data_parallel=horovod"])[-1]
    # One rank per pod: each process runs its pipeline over its pod's 4 GPUs.
    assert mpi_job["kind"] == "MPIJob" and mpi_job["spec"]["slotsPerWorker"] == 1
    assert _containers(mpi_job)["launcher"]["command"][:3] == ["horovodrun", "-np", "2"]
    assert _containers(mpi_job)["worker"]["resources"]["limits"] == {"nvidia.com/gpu": 4}


def test_tfjob_pods_take_their_cluster_from_the_operators_tf_config(tmp_path):
    config_map, tf_job = _write(tmp_path, "configs/parameter_server.yaml", "--workers", "2", "--flavor", "tfjob")
    assert yaml.safe_load(config_map["data"]["config.yaml"])["cluster"]["resolver"] == "config"
    worker = _containers(tf_job)["worker"]
    assert worker["name"] == "tensorflow" and worker["ports"][0]["name"] == "tfjob-port"


def _manifest(config, flavor, kind):
    overrides = [MULTI_WORKER[1]] if config == MULTI_WORKER[0] else []
    objects = k8s.manifests(load_config(config, overrides), k8s.Job(image="i", workers=2, flavor=flavor))
    return copy.deepcopy(next(o for o in objects if o["kind"] == kind))


@pytest.mark.parametrize("config,flavor,kind,path,message", [
    (MULTI_WORKER[0], "jobs", "ConfigMap", ["datta"], "`ConfigMap tfdist-config: (top)` fails Kubernetes"),
    (MULTI_WORKER[0], "jobs", "Service", ["spec", "selectr"], "`Service tfdist: spec` fails"),
    (MULTI_WORKER[0], "jobs", "Job", ["spec", "template", "spec", "containers", 0, "imagePullPolicyy"],
     "`Job tfdist-worker: spec.template.spec.containers[0]` fails"),
    ("configs/parameter_server.yaml", "jobset", "JobSet", ["spec", "replicatedJobs", 0, "replicass"],
     "`JobSet tfdist: spec.replicatedJobs[0].replicass` is not a field of JobsetV1alpha2ReplicatedJob"),
    ("configs/parameter_server.yaml", "jobset", "JobSet",
     ["spec", "replicatedJobs", 1, "template", "spec", "template", "spec", "containers", 0, "comand"],
     "`JobSet tfdist: spec.replicatedJobs[1].template.spec.template.spec.containers[0]` fails"),
    ("configs/parameter_server.yaml", "tfjob", "TFJob", ["spec", "tfReplicaSpecs", "Worker", "restartPolicyy"],
     "`TFJob tfdist: spec.tfReplicaSpecs.Worker.restartPolicyy` is not a field of KubeflowOrgV1ReplicaSpec"),
    ("configs/parameter_server.yaml", "tfjob", "TFJob",
     ["spec", "tfReplicaSpecs", "PS", "template", "spec", "containers", 0, "comand"],
     "`TFJob tfdist: spec.tfReplicaSpecs.PS.template.spec.containers[0]` fails"),
    ("configs/horovod.yaml", "jobs", "MPIJob", ["spec", "slotsPerWorkr"],
     "`MPIJob tfdist: spec.slotsPerWorkr` is not a field of spec"),
    ("configs/horovod.yaml", "jobs", "MPIJob", ["spec", "mpiReplicaSpecs", "Launcher", "template", "spec", "volumez"],
     "`MPIJob tfdist: spec.mpiReplicaSpecs.Launcher.template.spec` fails"),
])
def test_validation_catches_a_misspelled_field_in_every_kind(config, flavor, kind, path, message):
    obj = _manifest(config, flavor, kind)
    validate(obj)  # as written, it passes
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = 1
    with pytest.raises(ConfigError) as error:
        validate(obj)
    assert str(error.value).startswith(message), error.value


@pytest.mark.parametrize("config,flavor,kind,path,value,message", [
    ("configs/parameter_server.yaml", "tfjob", "TFJob", ["spec", "tfReplicaSpecs", "Worker", "replicas"], "2",
     "`TFJob tfdist: spec.tfReplicaSpecs.Worker.replicas` has the wrong type"),
    ("configs/parameter_server.yaml", "jobset", "JobSet", ["spec", "suspend"], "yes", "`JobSet tfdist: spec.suspend`"),
    ("configs/horovod.yaml", "jobs", "MPIJob", ["spec", "slotsPerWorker"], True, "`MPIJob tfdist: spec.slotsPerWorker`"),
    ("configs/horovod.yaml", "jobs", "MPIJob", ["apiVersion"], "kubeflow.org/v1", "`MPIJob tfdist: apiVersion` must be"),
])
def test_validation_catches_a_wrong_type(config, flavor, kind, path, value, message):
    obj = _manifest(config, flavor, kind)
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ConfigError, match="^" + message.replace("[", "\\[").replace("]", "\\]")):
        validate(obj)


@pytest.mark.parametrize("flags,message", [
    (["--workers", "2", "--config", "configs/default.yaml"], "`strategy.kind` runs in one process"),
    (["--workers", "2", "--config", "configs/parameter_server.yaml", "--image="], "`--image` is required"),
    (["--workers", "2", "--config", "configs/parameter_server.yaml", "--queue", "q"], "`--queue` with --flavor jobs"),
    (["--workers", "2", "--config", "configs/horovod.yaml", "--flavor", "tfjob"], "`--flavor` does not apply"),
    (["--workers", "0", "--config", "configs/horovod.yaml"], "`--workers` needs one worker or more"),
    (["--workers", "2", "--config", "configs/horovod.yaml", "--name", "My_Job"], "`--name` must be a DNS label"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, flags, message):
    out = tmp_path / "manifests"
    proc = run_tfdist("k8s", "--image", "repo/tfdist:0.1", "--out", str(out), *flags)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("tfdist: error: " + message), lines
    assert not out.exists()


@pytest.mark.parametrize("flags,kind", [(["--workers", "2"], "multi_worker_mirrored"),
                                        (["--workers", "2", "--ps", "1"], "parameter_server")])
def test_several_pods_and_no_kind_given_make_a_job_across_them_and_say_so(tmp_path, flags, kind):
    proc = run_tfdist("k8s", "--image", "repo/tfdist:0.1", "--out", str(tmp_path), *flags)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith(f"tfdist k8s: no strategy.kind given: 2 workers as strategy.kind={kind} ")
    assert f"kind: {kind}" in (tmp_path / "00-configmap-tfdist-config.yaml").read_text()


def test_the_kubernetes_resolver_needs_a_pods_environment(monkeypatch):
    from tfdist.cluster.resolver import cluster_resolver

    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    config = load_config(None, ["strategy.kind=multi_worker_mirrored", "cluster.resolver=kubernetes"])
    with pytest.raises(ConfigError, match="kubernetes needs the environment of a pod `tfdist k8s` wrote"):
        cluster_resolver(config)


def test_pod_hostnames_are_off_loopback_unless_the_config_allows_it(monkeypatch):
    from tfdist.cluster.resolver import cluster_resolver

    for name, value in {"JOB_COMPLETION_INDEX": "1", k8s.ROLE_ENV: "worker", k8s.TASKS_ENV: "ps=1,chief=1,worker=2",
                        k8s.HOST_ENV: "job-{role}-{index}.job"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(kubernetes.ADDRESSES_ENV, raising=False)
    overrides = ["strategy.kind=parameter_server", "cluster.resolver=kubernetes", "cluster.port_base=2222"]
    with pytest.raises(ConfigError, match="allow_non_loopback"):
        cluster_resolver(load_config(None, overrides))
    resolver = cluster_resolver(load_config(None, [*overrides, "cluster.allow_non_loopback=true"]))
    assert resolver.cluster_spec().as_dict() == {
        "ps": ["job-ps-0.job:2222"], "chief": ["job-chief-0.job:2222"],
        "worker": ["job-worker-0.job:2222", "job-worker-1.job:2222"],
    }
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)


def _pods(objects):
    """(pod DNS name, Job name, index, container, subdomain) for every pod the Jobs or the JobSet would create,
    named the way Kubernetes names them (not through tfdist's host pattern, which this checks)."""
    pods = []
    for obj in objects:
        if obj["kind"] == "Job":
            jobs = [(obj["metadata"]["name"], obj["spec"])]
        elif obj["kind"] == "JobSet":
            # JobSet names replicated job r's job i `JOBSET-r-i`, and its pods' subdomain is network.subdomain.
            jobs = [(f"{obj['metadata']['name']}-{r['name']}-{i}", r["template"]["spec"])
                    for r in obj["spec"]["replicatedJobs"] for i in range(r["replicas"])]
        else:
            continue
        for job_name, spec in jobs:
            pod = spec["template"]["spec"]
            subdomain = pod.get("subdomain") or obj["spec"]["network"]["subdomain"]
            for index in range(spec["completions"]):
                pods.append((f"{job_name}-{index}.{subdomain}", job_name, index, pod["containers"][0]))
    return pods


def _run_pods(tmp_path, objects):
    """Runs every pod's container command as a local process with the environment Kubernetes would give it,
    the ConfigMap at its mount path's stand-in, and the pods' hostnames pointed at loopback ports."""
    config_dir = tmp_path / "etc-tfdist"
    config_dir.mkdir()
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    for name, text in config_map["data"].items():
        (config_dir / name).write_text(text)
    pods = _pods(objects)
    first_port = free_port_block(len(pods))
    addresses = {f"{host}": f"127.0.0.1:{first_port + i}" for i, (host, *_) in enumerate(pods)}
    processes = []
    try:
        for host, job_name, index, container in pods:
            env = {**os.environ, **{e["name"]: e["value"] for e in container["env"]},
                   "JOB_COMPLETION_INDEX": str(index), "HOSTNAME": f"{job_name}-{index}",
                   kubernetes.ADDRESSES_ENV: json.dumps(addresses), "TF_CPP_MIN_LOG_LEVEL": "2"}
            command = [sys.executable if part == "python" else part.replace(k8s.CONFIG_DIR, str(config_dir))
                       for part in container["command"]]
            log = open(tmp_path / f"{job_name}-{index}.log", "w")
            processes.append((f"{job_name}-{index}", zygote.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)))
        for name, process in processes:
            code = process.wait(timeout=patient(400))
            assert code == 0, f"pod {name} exited {code}: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
    finally:
        for _, process in processes:
            process.kill()
    return {name for name, _ in processes}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("config,flags,sets", [
    (MULTI_WORKER[0], ["--workers", "2"], [MULTI_WORKER[1]]),
    ("configs/parameter_server.yaml", ["--workers", "2", "--flavor", "jobset"], []),
])
def test_the_pods_train_digits_when_run_as_local_processes(tmp_path, config, flags, sets):
    metrics = tmp_path / "metrics.json"
    objects = _write(tmp_path, config, *flags, "--metrics_out", str(metrics), sets=sets)
    pods = _run_pods(tmp_path, objects)
    assert len(pods) == (2 if "jobset" not in flags else 4)
    result = json.loads(metrics.read_text())
    assert result["final"]["val_accuracy"] >= 0.95
    assert result["num_replicas"] == 2 or result["strategy"] == "parameter_server"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_users_own_script_runs_in_the_pods(tmp_path):
    """TensorFlow's multi-worker guide as the pods' command: it finds the pods' cluster as `tfdist train` does."""
    model = tmp_path / "model.keras"
    guide = ["python", "examples/guide_multi_worker_keras.py", "--set", MULTI_WORKER[1], "--epochs", "1",
             "--steps_per_epoch", "3", "--model_path", str(model), "--backup_dir", str(tmp_path / "backup")]
    objects = _write(tmp_path, MULTI_WORKER[0], "--workers", "2", "--flavor", "jobset", "--", *guide,
                     sets=[MULTI_WORKER[1]])
    container = _pods(objects)[0][3]
    assert container["command"] == guide
    assert {"name": "TFDIST_CLUSTER", "value": '{"resolver": "kubernetes", "allow_non_loopback": true, '
            '"port_base": 29000}'} in container["env"]
    assert _run_pods(tmp_path, objects) == {"tfdist-worker-0-0", "tfdist-worker-0-1"}
    assert model.exists()


def test_a_parameter_server_jobs_workers_and_servers_serve_the_users_script(tmp_path):
    script = ["python", "train.py"]
    containers = _containers(_by_kind(_write(tmp_path, "configs/parameter_server.yaml", "--workers", "2", "--",
                                             *script))["Job", "tfdist-chief"])
    assert containers["chief"]["command"] == script
    for role in ("worker", "ps"):
        served = _containers(_by_kind(_write(tmp_path / role, "configs/parameter_server.yaml", "--", *script))[
            "Job", f"tfdist-{role}"])[role]
        assert served["command"] == ["python", "-m", "tfdist.cli", "serve", "--config", k8s.CONFIG_FILE]
    everywhere = _by_kind(_write(tmp_path / "every", "configs/parameter_server.yaml", "--every_task", "--", *script))
    assert _containers(everywhere["Job", "tfdist-worker"])["worker"]["command"] == script


def test_the_docs_k8s_commands_write_valid_manifests(tmp_path):
    page = open(os.path.join(ROOT, "docs", "launching.md")).read()
    block = page.split("## On Kubernetes: `tfdist k8s`")[1].split("```sh\n")[1].split("```")[0]
    commands = [line for line in block.replace("\\\n", " ").splitlines() if line.startswith("tfdist k8s ")]
    assert len(commands) == 3
    for number, command in enumerate(commands):
        args = command.split()[1:]
        args[args.index("--out") + 1] = str(tmp_path / str(number))
        proc = run_tfdist(*args)
        assert proc.returncode == 0, (command, proc.stderr)
        assert len(proc.stdout.split()) >= 2, command


@pytest.mark.slow
@pytest.mark.horovod
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_the_mpi_launchers_horovodrun_command_trains_over_an_operator_style_hostfile(tmp_path):
    metrics = tmp_path / "metrics.json"
    config_map, mpi_job = _write(tmp_path, "configs/horovod.yaml", "--workers", "1", "--gpus-per-worker", "2",
                                 "--metrics_out", str(metrics), sets=["train.epochs=3"])
    config_dir = tmp_path / "etc-tfdist"
    config_dir.mkdir()
    (config_dir / "config.yaml").write_text(config_map["data"]["config.yaml"])
    hostfile = tmp_path / "hostfile"  # as the MPI operator writes it for OpenMPI, the worker pod here
    hostfile.write_text(f"localhost slots={mpi_job['spec']['slotsPerWorker']}\n")
    replace = {"horovodrun": os.path.join(os.path.dirname(sys.executable), "horovodrun"), "python": sys.executable,
               "/etc/mpi/hostfile": str(hostfile)}
    command = [replace.get(part, part.replace(k8s.CONFIG_DIR, str(config_dir)))
               for part in _containers(mpi_job)["launcher"]["command"]]
    proc = zygote.run(command, cwd=ROOT, capture_output=True, text=True, timeout=patient(360),
                      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stdout[-2000:] + why_it_failed(proc.stderr)
    result = json.loads(metrics.read_text())
    assert result["strategy"] == "horovod" and result["num_replicas"] == 2


def _user_configs():
    """Every ```yaml block of the README and docs/, and every file in configs/: what users start from."""
    files = sorted(os.listdir(os.path.join(ROOT, "configs")))
    return ([pytest.param(block, id=f"{page}:{index}") for page, index, block in doc_blocks("yaml")]
            + [pytest.param(open(os.path.join(ROOT, "configs", name)).read(), id=name) for name in files])


@pytest.mark.parametrize("text", _user_configs())
def test_every_user_config_goes_through_config_and_k8s(text, tmp_path):
    """`tfdist config` prints it and `tfdist k8s` deploys it (a TFRecord block's features once crashed both)."""
    path = tmp_path / "job.yaml"
    path.write_text(text)
    printed = run_tfdist("config", "--config", str(path))
    assert printed.returncode == 0, printed.stderr
    resolved = load_config(str(path))
    assert from_dict(yaml.safe_load(printed.stdout)) == resolved
    # A one-process job goes to Kubernetes as several processes: data parallel across them.
    kind = resolved.strategy.kind
    spread = {"mirrored": ["strategy.kind=multi_worker_mirrored"], "pipeline": ["strategy.data_parallel=multi_worker"],
              "tensor_parallel": ["strategy.data_parallel=multi_worker"],
              "layout": ["strategy.data_parallel=multi_worker"]}.get(kind, [])
    objects = _write(tmp_path, str(path), "--workers", "2", sets=spread)
    for config_map in (o for o in objects if o["kind"] == "ConfigMap"):
        deployed = from_dict(yaml.safe_load(config_map["data"]["config.yaml"]))
        assert deployed.data == resolved.data and deployed.model == resolved.model
