"""The only place tfdist touches TensorFlow internals or probes optional packages.

Each function names the public behaviour it needs and why no public API gives it.
"""

from __future__ import annotations

__all__ = ["configure_coordination_service"]


def configure_coordination_service(
    cluster_spec, *, startup_timeout_seconds: float, heartbeat_timeout_seconds: float
) -> None:
    """Sets the multi-worker coordination service's timeouts before TF starts.

    MultiWorkerMirroredStrategy configures this service itself with TensorFlow's
    defaults: a peer that never starts is waited for an hour, with no public
    option to change it. Configured here first, the strategy keeps our settings
    (it only configures the service when none is set), so a missing peer fails
    after `startup_timeout_seconds` and a dead one after
    `heartbeat_timeout_seconds`.
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    jobs = cluster_spec.as_dict()
    leader_job = "chief" if "chief" in jobs else "worker"
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=f"/job:{leader_job}/replica:0/task:0",
        cluster_register_timeout_in_ms=int(startup_timeout_seconds * 1000),
        heartbeat_timeout_in_ms=int(heartbeat_timeout_seconds * 1000),
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in ("chief", "worker")
            if job in jobs
        ],
    )
    # Without the barrier, the register timeout is not enforced: the first
    # collective waits for missing tasks forever.
    context.context().coordination_service.cluster_register_with_barrier = True
