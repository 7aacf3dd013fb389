"""Hosts on this machine: Linux network namespaces on a bridge of the job's own, with shaped links.

`tfdist launch --hosts N --link RATE` runs each task in one of N namespaces.
A namespace behaves as a host: its own address on a private /24
(10.213.K.0/24, K free on this machine), its own loopback, and one link to
the bridge, shaped to RATE in both directions with `tc ... tbf` (a
full-duplex link). The hosts share this machine's cores and memory, and the
links add no latency (`netem` is not available), so a job shows what
bandwidth costs it, not what distance does. No route leads off the bridge:
no traffic leaves the machine.

Everything is named after the job's subnet (`tfdK`): the bridge and each
host's interface are both `tfdK` (so horovodrun's `--network-interface`
names one interface on the driver and on every host), the namespaces
`tfdK-hI`, the bridge's side of each link `tfdKvI`. `close()` removes them
all, after killing every process left in the namespaces. A launcher killed
outright cannot: a small reaper process it starts with the hosts removes
them when the launcher has gone without closing them (it waits on a pipe
only the launcher holds). Should the reaper be killed too, the next job
removes them (`/run/tfdist/hosts/tfdK` holds the owner's pid).

Horovod reaches its hosts as on a cluster, with ssh: `start_ssh()` runs an
sshd in each host, with a key kept in ~/.cache/tfdist/ssh (ssh records the
hosts in ~/.ssh/known_hosts, as for any host horovodrun reaches).
TensorFlow-free, like the launcher.
"""

from __future__ import annotations

import contextlib
import glob
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Optional

from tfdist.config.environment import HOST_INTERFACE_ENV, HOSTS_SUBNET_ENV
from tfdist.errors import ConfigError, HostsError

__all__ = ["NamespaceHosts", "link_bits_per_second"]

_OWNERS = "/run/tfdist/hosts"
BURST_SECONDS = 0.0005  # what of its rate a link passes at once after idle (tbf's bucket)
_NETNS_ETC = "/etc/netns"  # files here replace /etc's inside a namespace, under `ip netns exec`
_SSH_KEYS = os.path.join(os.path.expanduser("~"), ".cache", "tfdist", "ssh")
# tc's rate units (decimal; the `bps` ones count bytes).
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.I)
_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
         "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


def link_bits_per_second(rate: str) -> float:
    """`rate` in tc's notation (`100mbit`, `1gbit`, `10gbit`, `125mbps`) as bits per second.

    Raises:
      ConfigError: not a rate tc takes.
    """
    match = _RATE.match(rate.strip())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError("--link", "must be a rate in tc's notation: a number and bit, kbit, mbit, gbit or tbit "
                          "(or bps ... tbps for bytes), for example 1gbit.", rate)
    return float(match.group(1)) * _UNIT[match.group(2).lower()]


class NamespaceHosts:
    """`count` hosts in network namespaces, linked at `link` (a tc rate; None leaves links unshaped).

    Use as a context manager, or call `close()`: the namespaces, links and
    bridge exist from construction until then.

    Raises:
      HostsError: not root, `ip`/`tc` missing, or no free 10.213.K.0/24.
    """

    def __init__(self, count: int, link: Optional[str] = None):
        if not 1 <= count <= 253:
            raise ConfigError("--hosts", "must be from 1 to 253 (the hosts share one /24 with the bridge).", count)
        self.count, self.link = count, link
        self.bits_per_second = link_bits_per_second(link) if link else None
        _check_tools()
        _remove_abandoned()
        octet = _claim_subnet()
        self.tag, self.subnet = f"tfd{octet}", ipaddress.ip_network(f"10.213.{octet}.0/24")
        self.addresses = [str(self.subnet[i + 2]) for i in range(count)]
        self.namespaces = [f"{self.tag}-h{i}" for i in range(count)]
        self._sshd: list[subprocess.Popen] = []
        self._reaper = _start_reaper(self.tag)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    # --- Making and removing ------------------------------------------------------------------
    def _create(self) -> None:
        bridge = self.tag
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet[1]}/24", "dev", bridge)  # the launcher's own address (horovodrun's driver)
        _ip("link", "set", bridge, "up")
        for i, (namespace, address) in enumerate(zip(self.namespaces, self.addresses)):
            outside = f"{self.tag}v{i}"
            _ip("netns", "add", namespace)
            _write_hosts_file(namespace, address)
            _ip("link", "add", outside, "type", "veth", "peer", "name", self.tag, "netns", namespace)
            _ip("link", "set", outside, "master", bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", self.tag)
            _ip("-n", namespace, "link", "set", self.tag, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            if self.bits_per_second:
                self._shape(["ip", "netns", "exec", namespace], self.tag)  # what the host sends
                self._shape([], outside)  # what it receives

    def _shape(self, prefix: list[str], interface: str) -> None:
        # tbf's bucket lets a transfer after idle pass this much at once, faster than the rate. Half a
        # millisecond of it (at least 10 packets) keeps a step's transfer as slow as a real link's and
        # still reaches the rate in bulk; 4 ms let 600 KB at 1 Gbit/s through at 3.3 Gbit/s.
        burst = max(int(self.bits_per_second / 8 * BURST_SECONDS), 15_000)
        _run([*prefix, "tc", "qdisc", "add", "dev", interface, "root", "tbf", "rate", self.link,
              "burst", str(burst), "latency", "50ms"])

    def close(self) -> None:
        """Kills what still runs in the hosts and removes the namespaces, links, bridge and claim."""
        for process in self._sshd:
            process.kill()
            process.wait()
        self._sshd = []
        _remove_job(getattr(self, "tag", None))
        if getattr(self, "_reaper", None) is not None:
            os.write(self._reaper, _CLOSED)  # the reaper exits and removes nothing
            os.close(self._reaper)
            self._reaper = None

    def __enter__(self) -> "NamespaceHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- Using them ---------------------------------------------------------------------------
    def command(self, host: int, command: list[str]) -> list[str]:
        """`command` run inside host `host` (`ip netns exec` then execs it: same process, same pid)."""
        return ["ip", "netns", "exec", self.namespaces[host], *command]

    def environment(self) -> dict[str, str]:
        """What every task on these hosts gets in its environment."""
        return {HOSTS_SUBNET_ENV: str(self.subnet), HOST_INTERFACE_ENV: self.tag}

    def pids(self) -> list[int]:
        """Every process running in the hosts but their sshd (horovodrun's ranks are sshd's children, not
        the launcher's)."""
        listeners = {process.pid for process in self._sshd}
        return [pid for namespace in self.namespaces for pid in _pids_in(namespace) if pid not in listeners]

    def stop_tasks(self) -> None:
        """SIGKILLs whatever a job left running in the hosts (ranks whose ssh session ended without
        them), so that a restart finds its ports free; the hosts' sshd stay."""
        _kill_until_gone(self.pids)

    def link_bytes(self, host: int) -> tuple[int, int]:
        """(bytes sent, bytes received) by host `host` over its link since it was made."""
        statistics = f"/sys/class/net/{self.tag}v{host}/statistics"  # the bridge's side: rx is what the host sent
        with open(f"{statistics}/rx_bytes") as rx, open(f"{statistics}/tx_bytes") as tx:
            return int(rx.read()), int(tx.read())

    def start_ssh(self) -> str:
        """Starts an sshd in every host (once); returns the identity file that logs in to them."""
        if self._sshd:
            return _ssh_keys()[0]
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not os.path.exists(sshd):
            raise HostsError("Horovod reaches its hosts with ssh, and there is no sshd here: install openssh-server "
                             "(`make setup` does)")
        identity, host_key, authorized = _ssh_keys()
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        for host, address in enumerate(self.addresses):
            options = {"ListenAddress": address, "HostKey": host_key, "AuthorizedKeysFile": authorized,
                       "PermitRootLogin": "prohibit-password", "PasswordAuthentication": "no", "UsePAM": "no",
                       "StrictModes": "no", "PidFile": "none", "LogLevel": "ERROR"}
            flags = [item for key, value in options.items() for item in ("-o", f"{key}={value}")]
            command = self.command(host, [sshd, "-D", "-f", "/dev/null", *flags])
            self._sshd.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL, start_new_session=True))
        for process, address in zip(self._sshd, self.addresses):
            _wait_for_port(process, address, 22)
        return identity


def _claim_subnet() -> int:
    """A K with no link, namespace or route of 10.213.K.0/24 here, claimed for this process."""
    taken = _existing_links() | {name.split("-")[0] for name in _namespaces()}
    os.makedirs(_OWNERS, exist_ok=True)
    for octet in range(1, 255):
        tag = f"tfd{octet}"
        if tag in taken or _routes_to(f"10.213.{octet}.0/24"):
            continue
        try:  # the owner file is the claim: two launchers starting at once cannot both take K
            with open(os.path.join(_OWNERS, tag), "x") as f:
                f.write(str(os.getpid()))
        except FileExistsError:
            continue
        return octet
    raise HostsError("no free subnet 10.213.K.0/24 for the hosts' bridge (K = 1 ... 254 are all in use)")


def _check_tools() -> None:
    if os.geteuid() != 0:
        raise HostsError("--hosts needs root: network namespaces, links and tc shaping are made as root "
                         "(run as root, or leave out --hosts to run on loopback)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise HostsError(f"--hosts needs {' and '.join(missing)} (Debian: apt-get install iproute2)")


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise HostsError(f"`{' '.join(command)}` failed: {detail[-1] if detail else f'exit code {result.returncode}'}")
    return result.stdout


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _existing_links() -> set[str]:
    return set(os.listdir("/sys/class/net"))


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _routes_to(subnet: str) -> bool:
    """Whether this machine already routes into `subnet` (another network uses it)."""
    wanted = ipaddress.ip_network(subnet)
    for line in _ip("-4", "route", "show").splitlines():
        destination = line.split()[0]
        if destination != "default" and ipaddress.ip_network(destination, strict=False).overlaps(wanted):
            return True
    return False


def _pids_in(namespace: str) -> list[int]:
    try:
        return [int(pid) for pid in _ip("netns", "pids", namespace).split()]
    except HostsError:  # the namespace is gone
        return []


def _remove_job(tag: Optional[str]) -> None:
    """Removes everything named after `tag`; safe to call for a job half made or already removed."""
    if tag is None:
        return
    namespaces = [name for name in _namespaces() if name.startswith(f"{tag}-h")]
    # Processes first: a namespace with processes in it outlives `ip netns del`.
    _kill_until_gone(lambda: [pid for namespace in namespaces for pid in _pids_in(namespace)])
    for namespace in namespaces:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    for namespace in glob.glob(f"{_NETNS_ETC}/{tag}-h*"):
        shutil.rmtree(namespace, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(_NETNS_ETC)  # when no other namespace keeps files there
    for link in sorted(_existing_links()):
        if link == tag or re.fullmatch(rf"{tag}v\d+", link):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
    try:
        os.remove(os.path.join(_OWNERS, tag))
    except FileNotFoundError:
        pass


def _kill_until_gone(pids: Callable[[], list[int]], timeout: float = 5.0) -> None:
    """SIGKILLs the processes `pids()` names until it names none (or `timeout` passes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = pids()
        if not running:
            return
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


_CLOSED = b"c"  # what `close()` tells the reaper before the end of file


def _start_reaper(tag: str) -> int:
    """Starts the process that removes job `tag` once this one has gone without removing it; returns the write
    end of its pipe, which only this process holds (not inherited): its end, however it comes, is the reaper's
    end of file, with `_CLOSED` before it if `close()` removed the job."""
    reader, writer = os.pipe()
    subprocess.Popen([sys.executable, "-I", "-m", __name__, "--reap", tag, str(reader)], pass_fds=[reader],
                     stdin=subprocess.DEVNULL, start_new_session=True)  # not in the launcher's group: its Ctrl-C
    os.close(reader)
    return writer


def _reap(tag: str, reader: int) -> None:
    """Waits on `reader`: removes job `tag` at an end of file that `_CLOSED` did not come before."""
    if os.read(reader, 1) != _CLOSED:
        _remove_job(tag)


def _remove_abandoned() -> None:
    """Removes the hosts of jobs whose launcher no longer runs (killed outright, so it could not)."""
    if not os.path.isdir(_OWNERS):
        return
    for tag in os.listdir(_OWNERS):
        try:
            with open(os.path.join(_OWNERS, tag)) as f:
                os.kill(int(f.read().strip() or 0), 0)
        except (ProcessLookupError, ValueError):
            _remove_job(tag)
        except (PermissionError, FileNotFoundError):
            pass


def _write_hosts_file(namespace: str, address: str) -> None:
    """Has this machine's host name resolve to the host's own address inside it, as each machine's
    name does on a cluster: `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts. Horovod's
    process-set Gloo contexts find their address from the host name (they drop the interface given)."""
    os.makedirs(f"{_NETNS_ETC}/{namespace}", exist_ok=True)
    names = [name for name in dict.fromkeys([socket.getfqdn(), socket.gethostname()]) if name != "localhost"]
    with open(f"{_NETNS_ETC}/{namespace}/hosts", "w") as f:
        f.write(f"127.0.0.1 localhost\n{address} {' '.join(names)}\n")


def _ssh_keys() -> tuple[str, str, str]:
    """(client identity, host key, authorized_keys) in ~/.cache/tfdist/ssh, made once and kept, so the
    hosts' keys stay what ssh recorded in known_hosts."""
    os.makedirs(_SSH_KEYS, mode=0o700, exist_ok=True)
    identity, host_key = os.path.join(_SSH_KEYS, "id_ed25519"), os.path.join(_SSH_KEYS, "host_ed25519")
    for key in (identity, host_key):
        if not os.path.exists(key):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tfdist namespace hosts", "-f", key])
    authorized = os.path.join(_SSH_KEYS, "authorized_keys")
    shutil.copyfile(identity + ".pub", authorized)
    return identity, host_key, authorized


def _wait_for_port(process: subprocess.Popen, address: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise HostsError(f"sshd on {address} exited with code {process.returncode} (`sshd -t` shows why)")
        try:
            with socket.create_connection((address, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise HostsError(f"sshd on {address} did not listen within {timeout:.0f} s")


if __name__ == "__main__":  # the reaper: python -I -m tfdist.launch.hosts --reap TAG FD
    _reap(sys.argv[2], int(sys.argv[3]))
