"""Starting a job: every task on this machine (`local`, `tfdist launch`), an sbatch script (`slurm`),
Kubernetes manifests (`k8s`, validated by `k8s_validation`).

TensorFlow-free: the launcher runs beside the tasks it starts. It imports the
runtime's roles and ports from `tfdist.cluster`; nothing there imports back.
"""
