"""The only place tfdist touches TensorFlow internals or probes optional packages.

Each function names the public behaviour it needs and why no public API gives it.
"""

from __future__ import annotations

__all__ = ["configure_coordination_service", "graph_nodes", "loss_tracker"]


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


def graph_nodes(model):
    """The layer graph of a Sequential or functional Keras model.

    Keras has no public API for a model's nodes (which layer consumes which
    tensors); pipeline partitioning needs it to know what crosses a stage
    boundary. Returns `(nodes, inputs, outputs)`: `nodes` lists
    `(operation, input KerasTensors, output KerasTensors)` in an order where
    every node comes after the nodes it consumes; `inputs` and `outputs` are
    the model's KerasTensors.

    Raises:
      ValueError: the model is subclassed (it has no layer graph) or unbuilt.
    """
    import keras

    graph = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model
    if graph is None or not hasattr(graph, "_nodes_by_depth"):
        raise ValueError(
            f"`model` must be a built Sequential or functional model to be split into "
            f"pipeline stages; a subclassed model has no layer graph. Received: {model.name}"
        )
    nodes = []
    for depth in sorted(graph._nodes_by_depth, reverse=True):
        for node in graph._nodes_by_depth[depth]:
            if node.operation is None or node.is_input:
                continue
            nodes.append((node.operation, list(node.input_tensors), list(node.outputs)))
    return nodes, list(graph.inputs), list(graph.outputs)


def loss_tracker(model):
    """The `Mean` metric behind the `loss` entry of Keras's training logs.

    A training step written outside `Model.train_step` (the pipelined one)
    must update it as Keras's own step does; Keras keeps it private.
    """
    return model._loss_tracker
