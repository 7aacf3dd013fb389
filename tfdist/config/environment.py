"""Environment variables `tfdist launch` sets for the tasks it runs on namespace hosts (`--hosts`).

- TFDIST_HOSTS_SUBNET: the hosts' private subnet. Cluster addresses in it pass
  the loopback rule (tfdist.config.validation): it lies on a bridge of the
  job's own, with no route off the machine.
- TFDIST_HOST_INTERFACE: the host's link, whose byte counters the throughput
  figures read (`link_bytes_per_step`).
"""

HOSTS_SUBNET_ENV = "TFDIST_HOSTS_SUBNET"
HOST_INTERFACE_ENV = "TFDIST_HOST_INTERFACE"
