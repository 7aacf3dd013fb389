"""Schema validation of the manifests `tfdist k8s` writes, before anything is applied.

- Core objects (ConfigMap, Service, Job) and the pod and job templates inside
  custom resources: `kubernetes-validate` in strict mode (unknown fields are
  errors) for KUBERNETES_VERSION.
- JobSet (jobset.x-k8s.io/v1alpha2): the models `kubeflow-trainer-api`
  generates from JobSet's OpenAPI schema.
- TFJob (kubeflow.org/v1): the models `kubeflow-training` generates from the
  training operator's OpenAPI schema.
- MPIJob (kubeflow.org/v2beta1): no models are published on PyPI, so its own
  fields are checked against MPI_JOB_V2BETA1 below (the mpi-operator API's
  MPIJobSpec, ReplicaSpec and RunPolicy), and its pod templates as above.

The generated models ignore fields they do not know, so the walk here refuses
them first, naming the field's path.
"""

from __future__ import annotations

import re
import typing
from typing import Any

from tfdist.errors import ConfigError

__all__ = ["KUBERNETES_VERSION", "missing_packages", "validate"]

KUBERNETES_VERSION = "1.33"
CUSTOM_API_VERSIONS = {"JobSet": "jobset.x-k8s.io/v1alpha2", "TFJob": "kubeflow.org/v1", "MPIJob": "kubeflow.org/v2beta1"}

# mpi-operator v2beta1: each object's fields, a nested object as a dict, a map of them as {"*": ...}.
_RUN_POLICY = {"cleanPodPolicy": str, "ttlSecondsAfterFinished": int, "activeDeadlineSeconds": int,
               "backoffLimit": int, "schedulingPolicy": dict, "suspend": bool, "managedBy": str}
_REPLICA_SPEC = {"replicas": int, "restartPolicy": str, "template": "PodTemplateSpec"}
MPI_JOB_V2BETA1 = {
    "apiVersion": str, "kind": str, "metadata": "ObjectMeta",
    "spec": {"slotsPerWorker": int, "runLauncherAsWorker": bool, "runPolicy": _RUN_POLICY,
             "mpiReplicaSpecs": {"*": _REPLICA_SPEC}, "sshAuthMountPath": str, "launcherCreationPolicy": str,
             "mpiImplementation": str},
}


def missing_packages() -> list[str]:
    """The validators' packages that are not installed (`pip install 'tfdist[k8s]'` brings them)."""
    import importlib.util

    modules = {"kubernetes-validate": "kubernetes_validate", "kubeflow-trainer-api": "kubeflow_trainer_api",
               "kubeflow-training": "kubeflow.training"}
    missing = []
    for package, module in modules.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package (kubeflow) is absent
            found = False
        if not found:
            missing.append(package)
    return missing


def validate(obj: dict) -> None:
    """Checks one manifest against its kind's schema.

    Raises:
      ConfigError: naming the kind, the object and the path of the first field that is wrong.
    """
    kind = obj.get("kind")
    where = f"{kind} {obj.get('metadata', {}).get('name')}"
    if kind in CUSTOM_API_VERSIONS and obj.get("apiVersion") != CUSTOM_API_VERSIONS[kind]:
        raise ConfigError(f"{where}: apiVersion", f"must be {CUSTOM_API_VERSIONS[kind]}, the version these schemas "
                          "describe.", obj.get("apiVersion"))
    if kind in ("ConfigMap", "Service", "Job"):
        _core(obj, where, "")
    elif kind == "JobSet":
        from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

        _pydantic(obj, JobsetV1alpha2JobSet, where, "")
    elif kind == "TFJob":
        _openapi(obj, "KubeflowOrgV1TFJob", where, "")
    elif kind == "MPIJob":
        _fields(obj, MPI_JOB_V2BETA1, where, "")
        if "mpiReplicaSpecs" not in obj.get("spec", {}):
            raise ConfigError(f"{where}: spec.mpiReplicaSpecs", "is required.")
    else:
        raise ConfigError(where, "is not a kind tfdist writes (ConfigMap, Service, Job, JobSet, TFJob, MPIJob).")


def _core(obj: dict, where: str, root: str) -> None:
    """`obj` strictly against Kubernetes' schema; an error's path is given from `root`, where obj sits."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        inner = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path).lstrip(".")
        raise ConfigError(f"{where}: {(root + '.' + inner).strip('.') or '(top)'}",
                          f"fails Kubernetes {KUBERNETES_VERSION}'s schema: {e.message}.") from None


def _pod_template(template: Any, where: str, path: str) -> None:
    _core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "template"}, "template": template},
          where, _parent(path))


def _job_template(template: Any, where: str, path: str) -> None:
    _core({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "template"}, **template}, where, path)


def _object_meta(metadata: Any, where: str, path: str) -> None:
    _core({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata}, where, _parent(path))


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _unknown(where: str, path: str, owner: str) -> ConfigError:
    return ConfigError(f"{where}: {path}", f"is not a field of {owner}.")


def _fields(value: Any, schema: Any, where: str, path: str) -> None:
    """Walks a value against MPI_JOB_V2BETA1-style field tables."""
    if schema == "PodTemplateSpec":
        return _pod_template(value, where, path)
    if schema == "ObjectMeta":
        return _object_meta(value, where, path)
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {path}", f"must be an object. Received: {value!r}.")
        for key, item in value.items():
            field = schema.get(key, schema.get("*"))
            if field is None:
                raise _unknown(where, _join(path, key), path or "the object")
            _fields(item, field, where, _join(path, key))
    elif not isinstance(value, schema) or (schema is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: {path}", f"must be a {schema.__name__}. Received: {value!r}.")


def _pydantic(value: Any, annotation: Any, where: str, path: str) -> None:
    """Refuses fields a pydantic model (or a model nested in it) does not declare, then lets each model
    check its types and required fields, deepest first, so an error names its own path."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, typing.Annotated):
        for arg in args:
            if arg is not type(None):
                return _pydantic(value, arg, where, path)
    if origin is list and isinstance(value, list):
        for i, item in enumerate(value):
            _pydantic(item, args[0], where, f"{path}[{i}]")
        return
    if origin is dict and isinstance(value, dict):
        for key, item in value.items():
            _pydantic(item, args[1], where, _join(path, key))
        return
    fields = getattr(annotation, "model_fields", None)
    if fields is None or not isinstance(value, dict):
        return  # a scalar, or a wrong type the model itself reports
    if annotation.__name__ == "IoK8sApiBatchV1JobTemplateSpec":
        return _job_template(value, where, path)
    declared = {field.alias or name: field.annotation for name, field in fields.items()}
    for key, item in value.items():
        if key not in declared:
            raise _unknown(where, _join(path, key), annotation.__name__)
        _pydantic(item, declared[key], where, _join(path, key))
    import pydantic

    try:
        annotation.from_dict(value)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        raise ConfigError(f"{where}: {_join(path, '.'.join(str(p) for p in error['loc']))}",
                          f"{error['msg']}.") from None


_PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}


def _openapi(value: Any, type_name: str, where: str, path: str) -> Any:
    """Builds an openapi-generator model from `value`, refusing unknown fields; the models' own
    checks (required fields) run as each is built."""
    from kubeflow.training import models

    if type_name in ("V1PodTemplateSpec", "V1ObjectMeta"):
        (_pod_template if type_name == "V1PodTemplateSpec" else _object_meta)(value, where, path)
        return value
    if match := re.fullmatch(r"list\[(.+)\]", type_name):
        return [_openapi(item, match[1], where, f"{path}[{i}]") for i, item in enumerate(_of(value, list, where, path))]
    if match := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        return {key: _openapi(item, match[1], where, _join(path, key))
                for key, item in _of(value, dict, where, path).items()}
    if type_name in _PRIMITIVES:
        return _of(value, _PRIMITIVES[type_name], where, path)
    model = getattr(models, type_name)
    attributes = {key: attribute for attribute, key in model.attribute_map.items()}
    kwargs = {}
    for key, item in _of(value, dict, where, path).items():
        if key not in attributes:
            raise _unknown(where, _join(path, key), type_name)
        kwargs[attributes[key]] = _openapi(item, model.openapi_types[attributes[key]], where, _join(path, key))
    try:
        return model(**kwargs)
    except ValueError as e:
        raise ConfigError(f"{where}: {path or '(top)'}", f"{e}.") from None


def _of(value: Any, expected, where: str, path: str) -> Any:
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: {path}", f"has the wrong type. Received: {value!r}.")
    return value
