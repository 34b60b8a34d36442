"""Host lists and rank placement for ``hora run``.

Parses ``-H host1:4,host2:2`` and hostfiles into :class:`HostSpec` lists, and assigns ranks to
slots (:class:`SlotInfo`): ranks fill the first host's slots, then the next host's, and so on,
exactly as Horovod's launcher does.  Everything here is a pure function except
:func:`is_local_host`, which looks at this machine's names and addresses.

Layer: runner.  Imports nothing from hora but :mod:`hora.errors`.
"""
import dataclasses
import ipaddress
import os
import socket

__all__ = ["HostSpec", "SlotInfo", "parse_hosts", "parse_hostfile", "parse_hostfile_text",
           "resolve_hosts", "assign_slots", "is_local_host"]


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """One host of a job and how many processes (slots) it may run."""
    hostname: str
    slots: int


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """Where one rank runs and its place in the job's topology.

    Attributes:
        hostname: the host, as the user named it.
        rank: global rank, 0..size-1.
        local_rank: index of this rank among the ranks on its host.
        local_size: number of ranks on its host.
        cross_rank: index of its host among the hosts that have a rank with this local_rank.
        cross_size: number of hosts that have a rank with this local_rank.
        size: number of ranks in the job.
    """
    hostname: str
    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    size: int


def _parse_slots(text, where):
    try:
        slots = int(text)
    except ValueError:
        raise ValueError(f"{where}: slots must be a positive integer, got {text!r}") from None
    if slots < 1:
        raise ValueError(f"{where}: slots must be a positive integer, got {slots}")
    return slots


def _split_host_entry(entry, where):
    """``host``, ``host:N``, ``[v6addr]`` or ``[v6addr]:N`` -> (host, slots text or None)."""
    if entry.startswith("["):
        host, sep, rest = entry[1:].partition("]")
        if not sep or not host:
            raise ValueError(f"{where}: malformed bracketed host {entry!r}")
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise ValueError(f"{where}: expected ':<slots>' after {entry[:len(host) + 2]!r}")
        return host, rest[1:]
    if entry.count(":") > 1:        # a bare IPv6 address: no slot count possible
        return entry, None
    host, sep, slots = entry.partition(":")
    if not host:
        raise ValueError(f"{where}: empty host name in {entry!r}")
    return host, (slots if sep else None)


def _check_unique(specs, where):
    seen = set()
    for spec in specs:
        if spec.hostname in seen:
            raise ValueError(f"{where}: host {spec.hostname!r} is listed more than once")
        seen.add(spec.hostname)
    return specs


def parse_hosts(text):
    """Parse a ``-H`` value such as ``"host1:4,host2:2,host3"`` (slots default to 1).

    Returns:
        A list of :class:`HostSpec` in the order given.

    Raises:
        ValueError: on an empty list, an empty entry, a bad slot count or a repeated host.
    """
    where = f"-H {text!r}"
    entries = [e.strip() for e in text.split(",")]
    if not any(entries):
        raise ValueError(f"{where}: no hosts given")
    specs = []
    for entry in entries:
        if not entry:
            raise ValueError(f"{where}: empty entry (stray comma?)")
        host, slots = _split_host_entry(entry, where)
        specs.append(HostSpec(host, 1 if slots is None else _parse_slots(slots, where)))
    return _check_unique(specs, where)


def parse_hostfile_text(text, name="hostfile"):
    """Parse hostfile contents: lines ``host slots=N``, ``host:N`` or ``host``.

    ``#`` starts a comment; blank lines are skipped; ``max_slots=N`` (an MPI hostfile field)
    is accepted and ignored.

    Raises:
        ValueError: naming the file and line for anything else.
    """
    specs = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name}:{lineno}"
        first, *fields = line.split()
        host, slots = _split_host_entry(first, where)
        for field in fields:
            key, sep, value = field.partition("=")
            if sep and key == "slots":
                if slots is not None:
                    raise ValueError(f"{where}: slots given twice in {line!r}")
                slots = value
            elif sep and key == "max_slots":
                _parse_slots(value, where)
            else:
                raise ValueError(f"{where}: unexpected {field!r} (expected 'slots=N')")
        specs.append(HostSpec(host, 1 if slots is None else _parse_slots(slots, where)))
    if not specs:
        raise ValueError(f"{name}: no hosts in the file")
    return _check_unique(specs, name)


def parse_hostfile(path):
    """Read and parse the hostfile at ``path`` (see :func:`parse_hostfile_text`).

    Raises:
        ValueError: the file cannot be read (naming it and why), or is malformed.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        # a usage error: without this, the launcher would take the OSError for one raised
        # starting the command
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"hostfile {os.fspath(path)!r}: cannot read it: {why}") from e
    return parse_hostfile_text(text, name=os.fspath(path))


def resolve_hosts(np, hosts=None, hostfile=None):
    """The host list of a job: from ``hosts`` (``-H`` text or HostSpecs), a hostfile, or local.

    Without either, the job runs ``np`` processes on ``localhost``.

    Raises:
        ValueError: when both ``hosts`` and ``hostfile`` are given, or either is malformed.
    """
    if hosts is not None and hostfile is not None:
        raise ValueError("give either hosts (-H) or a hostfile, not both")
    if hostfile is not None:
        return parse_hostfile(hostfile)
    if hosts is None:
        _check_np(np)
        return [HostSpec("localhost", np)]
    if isinstance(hosts, str):
        return parse_hosts(hosts)
    specs = [h if isinstance(h, HostSpec) else HostSpec(*h) for h in hosts]
    for spec in specs:
        _parse_slots(spec.slots, f"host {spec.hostname!r}")
    return _check_unique(specs, "hosts")


def _check_np(np):
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise ValueError(f"the number of processes must be a positive integer, got {np!r}")


def assign_slots(hosts, np):
    """Place ``np`` ranks on ``hosts`` in host order and compute each rank's topology.

    Example:
        >>> [(s.hostname, s.rank, s.local_rank, s.cross_rank)
        ...  for s in assign_slots(parse_hosts("a:2,b:1"), 3)]
        [('a', 0, 0, 0), ('a', 1, 1, 0), ('b', 2, 0, 1)]

    Raises:
        ValueError: when ``np`` is not positive or exceeds the total number of slots.
    """
    _check_np(np)
    total = sum(h.slots for h in hosts)
    if np > total:
        listing = ",".join(f"{h.hostname}:{h.slots}" for h in hosts)
        raise ValueError(f"-np {np} exceeds the {total} slots available on the hosts ({listing})")
    placed = []                                   # (host index, hostname, local_rank)
    for index, host in enumerate(hosts):
        take = min(host.slots, np - len(placed))
        placed.extend((index, host.hostname, local) for local in range(take))
        if len(placed) == np:
            break
    local_size = {}
    hosts_with_local = {}                         # local_rank -> host indices, in host order
    for index, _, local in placed:
        local_size[index] = local_size.get(index, 0) + 1
        hosts_with_local.setdefault(local, []).append(index)
    return [SlotInfo(hostname=name, rank=rank, local_rank=local, local_size=local_size[index],
                     cross_rank=hosts_with_local[local].index(index),
                     cross_size=len(hosts_with_local[local]), size=np)
            for rank, (index, name, local) in enumerate(placed)]


def _local_names():
    names = {"localhost", "localhost.localdomain", "ip6-localhost"}
    for get in (socket.gethostname, socket.getfqdn):
        try:
            names.add(get().lower())
        except OSError:
            pass
    return names


def _is_local_address(addr):
    """True when ``addr`` is loopback or one of this machine's interface addresses."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    if ip.is_unspecified:
        return False
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    # only an address of one of our interfaces can be bound
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.bind((addr, 0))
        return True
    except OSError:
        return False


def is_local_host(hostname):
    """Whether ``hostname`` names this machine: localhost, 127.x, ::1, our name or address.

    A name that is neither a known local name nor an address is resolved (it may take as long
    as the system resolver does); a name that does not resolve is not local.
    """
    name = hostname.strip().strip("[]").lower()
    if name in _local_names() or _is_local_address(name):
        return True
    try:
        ipaddress.ip_address(name.split("%", 1)[0])
        return False                              # an address, and not one of ours
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(_is_local_address(info[4][0]) for info in infos)
