"""`tfdist k8s`: the Kubernetes manifests of a tfdist job.

`tfdist k8s` writes, for a multi-worker or parameter-server job, a ConfigMap
holding the resolved config, a headless Service, and one Indexed Job per role
(`--flavor jobs`, no operator needed), or one JobSet with a replicated job per
role (`--flavor jobset`: one workload, so Kueue admits every role together).
Each pod runs `tfdist train` with `cluster.resolver: kubernetes` and finds its
cluster from the environment written here (`tfdist.cluster.kubernetes`). A Horovod job is an
MPIJob (kubeflow.org/v2beta1) whose launcher runs horovodrun over the worker
pods; `--flavor tfjob` writes the training operator's TFJob (kubeflow.org/v1),
which sets TF_CONFIG itself. With a command of the user's (`tfdist k8s ... --
python train.py`) the containers run it instead, and find the cluster as the
pods' config says (`CLUSTER_VARIABLE`); under parameter servers only the
chief runs it and the workers and servers are `tfdist serve`, unless
`every_task`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

import yaml

from tfdist.config import to_dict
from tfdist.config.loading import CLUSTER_VARIABLE, cluster_variable
from tfdist.config.kinds import RANKS
from tfdist.config.schema import ClusterResolverKind, Config
from tfdist.cluster.kubernetes import HOST_ENV, ROLE_ENV, TASKS_ENV
from tfdist.cluster.roles import multi_process_kinds
from tfdist.errors import ConfigError

__all__ = ["Job", "FLAVORS", "manifests", "write"]

FLAVORS = ("jobs", "jobset", "tfjob")
CONFIG_DIR = "/etc/tfdist"
CONFIG_FILE = f"{CONFIG_DIR}/config.yaml"
CONTAINER = "tensorflow"  # the name TFJob's operator looks for; kept for every flavor
JOB_LABEL = "tfdist.dev/job"
ROLE_LABEL = "tfdist.dev/role"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True)
class Job:
    """What `tfdist k8s` was asked for, besides the config.

    Attributes:
      name: the job's name (a DNS label); objects are named after it.
      image: the container image, with tfdist installed.
      workers: worker pods (Horovod: ranks).
      ps: parameter-server pods (0: parameter_server.num_ps).
      gpus_per_worker: `nvidia.com/gpu` per worker pod (0: none).
      cpu, memory: each pod's resource requests.
      flavor: jobs, jobset or tfjob (Horovod always writes an MPIJob).
      queue: a Kueue LocalQueue: the workloads carry its label and start suspended.
      namespace: where the objects go (None: kubectl's current namespace).
      priority_class: the pods' PriorityClass (Kueue takes the workload's priority from it).
      metrics_out: the chief's `--metrics_out` path inside its pod.
      command: a command of the user's for the containers to run instead of `tfdist train`.
      every_task: run `command` on a parameter-server job's workers and servers too.
    """

    name: str = "tfdist"
    image: str = ""
    workers: int = 1
    ps: int = 0
    gpus_per_worker: int = 0
    cpu: str = "2"
    memory: str = "8Gi"
    flavor: str = "jobs"
    queue: Optional[str] = None
    namespace: Optional[str] = None
    priority_class: Optional[str] = None
    metrics_out: Optional[str] = None
    command: tuple[str, ...] = ()
    every_task: bool = False


def roles(config: Config, job: Job) -> dict[str, int]:
    """Pods per role, in the order the tasks start."""
    if config.strategy.launched_as.processes.coordinated:
        return {"ps": job.ps or config.parameter_server.num_ps, "chief": 1, "worker": job.workers}
    return {"worker": job.workers}


def manifests(config: Config, job: Job) -> list[dict]:
    """The objects that run `config` as `job`, in the order to apply them.

    Raises:
      ConfigError: a kind that runs in one process, a bad name or count, or a
        flavor that does not fit the kind.
    """
    _check(config, job)
    if config.strategy.launched_as.processes is RANKS:
        rank_per_gpu = config.strategy.spec.processes is RANKS
        return [_config_map(config, job), _mpi_job(config, job, rank_per_gpu=rank_per_gpu)]
    if job.flavor == "tfjob":
        return [_config_map(config, job), _tf_job(config, job)]
    if job.flavor == "jobset":
        host = f"{job.name}-{{role}}-0-{{index}}.{job.name}"  # JobSet's pod hostnames: jobset-rjob-jobindex-podindex
        return [_config_map(config, job), _job_set(config, job, host)]
    host = f"{job.name}-{{role}}-{{index}}.{job.name}"  # an Indexed Job's pod hostname is job-index
    return [_config_map(config, job), _service(config, job),
            *(_indexed_job(config, job, role, count, host) for role, count in roles(config, job).items())]


def write(objects: list[dict], out_dir: str) -> list[str]:
    """Writes each object to `out_dir/NN-kind-name.yaml`; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for number, obj in enumerate(objects):
        path = os.path.join(out_dir, f"{number:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml")
        with open(path, "w") as f:
            yaml.dump(obj, f, Dumper=_PlainDumper, sort_keys=False)
        paths.append(path)
    return paths


class _PlainDumper(yaml.SafeDumper):
    """Writes a repeated value out again, not as a YAML alias (`*id001`), so each object reads alone."""

    def ignore_aliases(self, data):
        return True


def _literal_if_multiline(dumper: yaml.SafeDumper, text: str):
    """The ConfigMap's config.yaml as a readable block, not one escaped line."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_PlainDumper.add_representer(str, _literal_if_multiline)


def _check(config: Config, job: Job) -> None:
    kind = config.strategy.launched_as
    if not kind.processes.several:
        raise ConfigError("strategy.kind", f"runs in one process; `k8s` writes jobs of {multi_process_kinds()}.",
                          kind.name)
    if not _DNS_LABEL.fullmatch(job.name) or len(job.name) > 40:
        raise ConfigError("--name", "must be a DNS label of at most 40 characters (lowercase letters, digits "
                          "and '-', starting with a letter): pod hostnames add the role and index to it.", job.name)
    if not job.image:
        raise ConfigError("--image", "is required: the container image with tfdist installed.", job.image)
    if job.flavor not in FLAVORS:
        raise ConfigError("--flavor", f"must be one of {', '.join(FLAVORS)}.", job.flavor)
    if kind.processes is RANKS and job.flavor != "jobs":
        raise ConfigError("--flavor", f"does not apply to strategy.kind={kind.name}, which always runs as an MPIJob.",
                          job.flavor)
    if job.workers < 1 or job.ps < 0 or job.gpus_per_worker < 0:
        raise ConfigError("--workers", "needs one worker or more, and --ps and --gpus-per-worker 0 or more.",
                          job.workers)
    if kind.processes.coordinated and roles(config, job)["ps"] < 1:
        raise ConfigError("--ps", "a parameter-server job needs one parameter server or more.", job.ps)
    if job.queue and job.flavor == "jobs" and len(roles(config, job)) > 1:
        raise ConfigError("--queue", "with --flavor jobs each role is its own Job, which Kueue would admit on "
                          "its own (a chief without its workers waits); use --flavor jobset, which it admits "
                          "as one workload.", job.queue)


def _pod_config(config: Config, job: Job) -> dict:
    """The config the pods read: the cluster from Kubernetes (or TF_CONFIG under TFJob), addresses off loopback."""
    data = to_dict(config)
    uses_resolver = config.strategy.launched_as.processes.resolves_cluster and job.flavor != "tfjob"
    resolver_kind = ClusterResolverKind.KUBERNETES if uses_resolver else ClusterResolverKind.CONFIG
    data["cluster"].update(resolver=resolver_kind.value, allow_non_loopback=True)
    if config.strategy.launched_as.processes.coordinated:
        data["parameter_server"].update(num_workers=job.workers, num_ps=roles(config, job)["ps"])
    return data


def _config_map(config: Config, job: Job) -> dict:
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(job, f"{job.name}-config"),
        "data": {"config.yaml": yaml.safe_dump(_pod_config(config, job), sort_keys=False)},
    }


def _metadata(job: Job, name: str, *, workload: bool = False, role: Optional[str] = None) -> dict:
    labels = {JOB_LABEL: job.name, **({ROLE_LABEL: role} if role else {})}
    if workload and job.queue:
        labels[QUEUE_LABEL] = job.queue
    return {"name": name, **({"namespace": job.namespace} if job.namespace else {}), "labels": labels}


def _task_command(config: Config, job: Job, role: str = "worker") -> list[str]:
    """What a container of `role` runs: `tfdist train`, or the user's command (a parameter-server job's
    workers and servers serve it, unless `every_task`)."""
    tfdist = ["python", "-m", "tfdist.cli"]
    if not job.command:
        metrics = [f"--metrics_out={job.metrics_out}"] if job.metrics_out else []  # only the chief writes it
        return [*tfdist, "train", "--config", CONFIG_FILE, *metrics]
    if config.strategy.launched_as.processes.coordinated and role != "chief" and not job.every_task:
        return [*tfdist, "serve", "--config", CONFIG_FILE]
    return list(job.command)


def _command_env(config: Config, job: Job) -> list[dict]:
    """For the user's command: the pods' cluster keys (`tfdist train` reads them from the ConfigMap)."""
    if not job.command:
        return []
    cluster = _pod_config(config, job)["cluster"]
    value = cluster_variable(cluster["resolver"], cluster["port_base"], cluster["allow_non_loopback"])
    return [{"name": CLUSTER_VARIABLE, "value": value}]


def _container(config: Config, job: Job, role: str, command: list[str], env: list[dict]) -> dict:
    container = {"name": CONTAINER, "image": job.image, "command": command, "env": env,
                 "resources": {"requests": {"cpu": job.cpu, "memory": job.memory}},
                 "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]}
    if config.strategy.launched_as.processes.resolves_cluster:
        port_name = "tfjob-port" if job.flavor == "tfjob" else "tfdist"  # the operator finds it by that name
        container["ports"] = [{"name": port_name, "containerPort": config.cluster.port_base}]
    if job.gpus_per_worker and role == "worker":
        container["resources"]["limits"] = {"nvidia.com/gpu": job.gpus_per_worker}
    return container


def _pod_template(job: Job, role: str, container: dict, *, restart: str,
                  subdomain: Optional[str] = None) -> dict:
    spec = {"restartPolicy": restart, "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": f"{job.name}-config"}}]}
    if subdomain:
        spec["subdomain"] = subdomain
    if job.priority_class:
        spec["priorityClassName"] = job.priority_class
    return {"metadata": {"labels": {JOB_LABEL: job.name, ROLE_LABEL: role}}, "spec": spec}


def _restart_policy(config: Config, role: str) -> str:
    """A parameter-server job's worker restarts in place (same hostname; the coordinator takes it back);
    any other task's failure ends the job."""
    coordinated = config.strategy.launched_as.processes.coordinated
    return "OnFailure" if coordinated and role == "worker" else "Never"


def _job_spec(config: Config, job: Job, role: str, count: int, host: str, subdomain: str) -> dict:
    """An Indexed Job's spec: `count` pods of `role`, each told the job's shape."""
    shape = ",".join(f"{r}={n}" for r, n in roles(config, job).items())
    env = [{"name": ROLE_ENV, "value": role}, {"name": TASKS_ENV, "value": shape}, {"name": HOST_ENV, "value": host},
           {"name": "PYTHONUNBUFFERED", "value": "1"}, *_command_env(config, job)]
    restart = _restart_policy(config, role)
    container = _container(config, job, role, _task_command(config, job, role), env)
    return {
        "completionMode": "Indexed", "completions": count, "parallelism": count,
        "backoffLimit": 6 if restart == "OnFailure" else 0,
        "template": _pod_template(job, role, container, restart=restart, subdomain=subdomain),
    }


def _service(config: Config, job: Job) -> dict:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(job, job.name),
        "spec": {
            "clusterIP": "None",  # headless: one DNS record per pod, by hostname
            "publishNotReadyAddresses": True,  # tasks look each other up before they are ready
            "selector": {JOB_LABEL: job.name},
            "ports": [{"name": "tfdist", "port": config.cluster.port_base}],
        },
    }


def _indexed_job(config: Config, job: Job, role: str, count: int, host: str) -> dict:
    spec = _job_spec(config, job, role, count, host, subdomain=job.name)
    if job.queue:
        spec["suspend"] = True
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _metadata(job, f"{job.name}-{role}", workload=True, role=role), "spec": spec}


def _job_set(config: Config, job: Job, host: str) -> dict:
    done_when = "chief" if config.strategy.launched_as.processes.coordinated else "worker"
    spec = {
        "network": {"enableDNSHostnames": True, "subdomain": job.name, "publishNotReadyAddresses": True},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [done_when]},
        "failurePolicy": {"maxRestarts": 0},
        "replicatedJobs": [
            {"name": role, "replicas": 1, "template": {"spec": _job_spec(config, job, role, count, host, job.name)}}
            for role, count in roles(config, job).items()
        ],
    }
    if job.queue:
        spec["suspend"] = True
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": _metadata(job, job.name, workload=True), "spec": spec}


def _run_policy(job: Job) -> dict:
    return {"cleanPodPolicy": "Running", **({"suspend": True} if job.queue else {})}


def _tf_job(config: Config, job: Job) -> dict:
    replica_specs = {}
    for role, count in roles(config, job).items():
        restart = _restart_policy(config, role)
        container = _container(config, job, role, _task_command(config, job, role),
                               [{"name": "PYTHONUNBUFFERED", "value": "1"}, *_command_env(config, job)])
        replica_specs["PS" if role == "ps" else role.capitalize()] = {
            "replicas": count, "restartPolicy": restart,
            "template": _pod_template(job, role, container, restart=restart),
        }
    return {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": _metadata(job, job.name, workload=True),
            "spec": {"runPolicy": _run_policy(job), "tfReplicaSpecs": replica_specs}}


def _mpi_job(config: Config, job: Job, *, rank_per_gpu: bool = True) -> dict:
    """horovodrun on the launcher reaches the workers by ssh (the MPI operator gives it their hostfile and
    keys), so the image runs sshd on the workers. One rank per GPU, or (a pipeline or tensor-parallel job,
    whose process spans its pod's GPUs) one per pod."""
    slots = max(1, job.gpus_per_worker) if rank_per_gpu else 1
    ranks = job.workers * slots
    launch = ["horovodrun", "-np", str(ranks), "--hostfile", "/etc/mpi/hostfile", "--gloo",
              *_task_command(config, job)]
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    launcher = {"name": CONTAINER, "image": job.image, "command": launch, "env": env,
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]}
    worker = {**launcher, "command": ["/usr/sbin/sshd", "-De"],
              "resources": {"requests": {"cpu": job.cpu, "memory": job.memory}}}
    if job.gpus_per_worker:
        worker["resources"]["limits"] = {"nvidia.com/gpu": job.gpus_per_worker}
    return {
        "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": _metadata(job, job.name, workload=True),
        "spec": {
            "slotsPerWorker": slots, "runPolicy": _run_policy(job), "mpiImplementation": "OpenMPI",
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "restartPolicy": "Never", "template": _pod_template(
                    job, "launcher", launcher, restart="Never")},
                "Worker": {"replicas": job.workers, "restartPolicy": "Never", "template": _pod_template(
                    job, "worker", worker, restart="Never")},
            },
        },
    }
