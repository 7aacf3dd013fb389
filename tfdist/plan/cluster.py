"""The machines a plan is for: devices, their memory and speed, and the links between them.

`Cluster` is given by flags (`--devices 16 --hosts 2 --device_memory 80GiB
--device_tflops 125 --link 200gbit --intra_link 600GB/s`) or a preset
(`--cluster 2x8-a100-80g-ib`). A preset states a device's peak rate for its
dtypes from the vendor's datasheet, which the planner derates by
`SUSTAINED_SHARE` unless a rate is given.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from tfdist.errors import ConfigError

__all__ = ["HOST_LINK_EFFICIENCY", "PRESETS", "SUSTAINED_SHARE", "Cluster", "format_bytes", "from_preset",
           "parse_bytes", "parse_duration", "parse_rate"]

# TCP over IPv4 on Ethernet carries 1448 bytes of data in each 1538-byte frame on the wire (MTU 1500, with
# TCP timestamps; preamble, header, FCS and gap around it): a host link moves data at this share of its rate.
HOST_LINK_EFFICIENCY = 1448 / 1538

# The share of a datasheet's peak a training step sustains, when nothing better is known (large
# transformer runs report 30-55% model FLOPs utilization; convolutional ones less).
SUSTAINED_SHARE = 0.4


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Attributes:
      devices: accelerators (or CPU devices) in all.
      hosts: machines they are spread over, evenly.
      device_memory: bytes per device.
      device_flops: sustained FLOP/s of one device in a training step (0: measure, or unknown).
      link: bits/s of each host's link to the others.
      intra_link: bytes/s between two devices of one host.
      link_latency: seconds a step across hosts costs beyond its bytes (a collective's set-up and
        round trips, a parameter server's requests; 0: not counted).
      host_rate: bytes/s a host's transport serializes and copies, on top of the time on the wire:
        gRPC, or Gloo or MPI over TCP, handle every byte on the host's cores, and gRPC builds a
        tensor's whole message before it sends it and parses it after it arrives (0: not counted, as
        with RDMA).
      variable_latency: seconds each trainable variable adds to a parameter-server worker's step
        beyond its bytes: the worker reads it and sends its gradient with an RPC of their own each
        (0: not counted; the all-reduce kinds pack every gradient into one collective).
      host_cores: the cores a host's devices share, when they do (logical CPU devices of one
        process; 0: each device computes on its own): a step then takes at least all the host's
        devices' CPU time over its cores, however the devices' work is scheduled, and a
        tensor-parallel group's devices take turns.
      source: where the figures come from.
    """

    devices: int
    hosts: int = 1
    device_memory: float = 0.0
    device_flops: float = 0.0
    link: float = 0.0
    intra_link: float = 0.0
    link_latency: float = 0.0
    host_rate: float = 0.0
    variable_latency: float = 0.0
    host_cores: int = 0
    source: str = "flags"

    def __post_init__(self):
        if self.devices < 1 or self.hosts < 1 or self.devices % self.hosts:
            raise ConfigError("--devices", f"must be a positive multiple of --hosts ({self.hosts}).", self.devices)
        if self.hosts > 1 and self.link <= 0:
            raise ConfigError("--link", "must be given for more than one host: the rate of each host's link.",
                              self.link)

    @property
    def per_host(self) -> int:
        return self.devices // self.hosts

    @property
    def across_hosts(self) -> float:
        """Bytes/s of data each way over a host's link, less its framing."""
        return HOST_LINK_EFFICIENCY * self.link / 8

    def transport_ms(self, nbytes: float) -> float:
        """Milliseconds the hosts' transport spends on `nbytes` besides the wire (`host_rate`)."""
        return 1000 * nbytes / self.host_rate if self.host_rate else 0.0

    def crossing_ms(self, wire_ms: float, nbytes: float) -> float:
        """A step's time across hosts for `nbytes` that spend `wire_ms` on the wire: its fixed cost
        (`link_latency`), the wire and the transport's work on the bytes, one after another (a
        message's latency plus its bytes over the rate, as the alpha-beta model of a network has it)."""
        return 1000 * self.link_latency + wire_ms + self.transport_ms(nbytes)


# name: (devices per host, memory, peak FLOP/s by compute dtype, host link bits/s, intra-host bytes/s, source)
PRESETS = {
    "1x8-a100-80g": (8, 80 * 2**30, {"float32": 19.5e12, "float16": 312e12, "bfloat16": 312e12}, 0.0, 600e9,
                     "NVIDIA A100 datasheet (SXM4 80GB: 19.5 TFLOPS FP32, 312 TFLOPS FP16/BF16 Tensor Core; "
                     "NVLink 600 GB/s)"),
    "2x8-a100-80g-ib": (8, 80 * 2**30, {"float32": 19.5e12, "float16": 312e12, "bfloat16": 312e12}, 8 * 200e9,
                        600e9, "NVIDIA A100 and DGX A100 datasheets (8 x 200 Gb/s HDR InfiniBand a host)"),
    "1x8-v100-32g": (8, 32 * 2**30, {"float32": 15.7e12, "float16": 125e12, "bfloat16": 15.7e12}, 0.0, 300e9,
                     "NVIDIA V100 datasheet (SXM2 32GB: 15.7 TFLOPS FP32, 125 TFLOPS Tensor Core; NVLink "
                     "300 GB/s)"),
    # The machines of two published scaling runs (tfdist.plan.published compares the planner with them).
    "128x4-p100-25g-roce": (4, 16 * 2**30, {"float32": 9.3e12, "float16": 18.7e12, "bfloat16": 9.3e12}, 25e9, 16e9,
                            "Horovod's benchmark (128 servers of 4 Pascal GPUs, RoCE 25 Gbit/s; Sergeev and Del Balso, "
                            "arXiv:1802.05799); NVIDIA P100 PCIe datasheet (9.3 TFLOPS FP32, 18.7 FP16); PCIe 3.0 x16 "
                            "16 GB/s"),
    "32x8-p100-50g": (8, 16 * 2**30, {"float32": 10.6e12, "float16": 21.2e12, "bfloat16": 10.6e12}, 50e9, 160e9,
                      "Goyal et al., arXiv:1706.02677 (Big Basin servers: 8 P100 on NVLink, 50 Gbit/s Ethernet); "
                      "NVIDIA P100 SXM2 datasheet (10.6 TFLOPS FP32, 21.2 FP16; NVLink 160 GB/s)"),
}

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*$", re.I)
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)\s*$", re.I)
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|B/s)\s*$", re.I)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def format_bytes(nbytes: float) -> str:
    """`nbytes` in binary units to 3 figures: `97.3 GiB`, `452 KiB`, `12 B`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def parse_bytes(text: str, flag: str) -> float:
    """`80GiB`, `16GB`, `512MiB` as bytes."""
    match = _BYTES.match(text or "")
    if not match:
        raise ConfigError(flag, "must be a size such as 80GiB or 16GB.", text)
    unit = match.group(2).upper()
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return float(match.group(1)) * ((1024 if "I" in unit else 1000) ** power)


def parse_rate(text: str, flag: str) -> float:
    """A rate as bits per second: tc's notation (`100mbit`, `10gbit`; `600gbps` is bytes), or `600GB/s`."""
    match = _RATE.match(text or "")
    if not match:
        raise ConfigError(flag, "must be a rate such as 100gbit, 25gbit or 600GB/s.", text)
    bits = 1 if match.group(3).lower() == "bit" else 8
    return float(match.group(1)) * _SCALE[match.group(2).lower()] * bits


def parse_duration(text: str, flag: str) -> float:
    """`2ms`, `50us`, `0.1s` as seconds."""
    match = _DURATION.match(text or "")
    if not match:
        raise ConfigError(flag, "must be a duration such as 2ms, 50us or 0.1s.", text)
    return float(match.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[match.group(2).lower()]


def from_preset(name: str, hosts: Optional[int], compute_dtype: str) -> Cluster:
    """The preset's cluster (`NxM-...`: N hosts of M devices, unless `hosts` says otherwise)."""
    if name not in PRESETS:
        raise ConfigError("--cluster", f"must be one of {', '.join(PRESETS)}.", name)
    per_host, memory, peak, link, intra, source = PRESETS[name]
    hosts = hosts or int(name.split("x", 1)[0])
    return Cluster(devices=hosts * per_host, hosts=hosts, device_memory=memory,
                   device_flops=SUSTAINED_SHARE * peak.get(compute_dtype, peak["float32"]), link=link,
                   intra_link=intra, source=f"{name}: {source}; {SUSTAINED_SHARE:.0%} of peak sustained")
