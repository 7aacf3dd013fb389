"""The runtime of a multi-process job: where this task is and who its peers are.

- `resolver`: the cluster from the config's `cluster` section, TF_CONFIG, a
  Slurm job step (`slurm`) or a Kubernetes pod (`kubernetes`);
- `roles`: the roles of a job's tasks, in task order, on every launcher;
- `servers`: parameter-server jobs' worker and ps tasks (`serve`), and a
  whole local cluster of them on loopback (`LocalCluster`);
- `loopback`: free ports and liveness checks (TensorFlow-free).

The writers that start jobs (`tfdist.launch`) import from here, never the reverse.
"""
