"""Ray's hosts for an elastic job: which hosts there are and how many slots each has
(:class:`RayHostDiscovery`, or the caller's discovery, asked through
:class:`PolledDiscovery`), and where on the cluster a host's actors go
(:func:`actor_options`).

A host that names a Ray node (its address, ``address-<node id prefix>``, its node id, or a
``node:<host>`` custom resource of it) pins its actors to that node; any other name is a
logical host whose actors Ray may place anywhere.

Layer: integrations.  ``ray`` is imported lazily; imports the runner's discovery bound and
host specs.
"""
import concurrent.futures
import logging
import math

from ..errors import HoraError
from ..runner.discovery import DISCOVERY_TIMEOUT_S
from ..runner.hosts import HostSpec

__all__ = ["PolledDiscovery", "RayHostDiscovery", "actor_options", "host_specs", "ray_nodes"]

log = logging.getLogger(__name__)


class RayHostDiscovery:
    """Ray's live nodes as hosts (Horovod's class of that name): ``{address: slots}``, where
    a node's slots are its ``CPU`` count over ``cpus_per_slot`` and, with ``use_gpu``, at
    most its ``GPU`` count over ``gpus_per_slot``.  Nodes without a slot are left out.  Two
    nodes with one address (a cluster of nodes on one machine) are told apart as
    ``address-<node id prefix>``.

    The whole cluster is taken to be the job's, as Horovod takes it: the counts are the
    nodes' totals, not what other Ray work leaves free.
    """

    def __init__(self, use_gpu=False, cpus_per_slot=1, gpus_per_slot=1):
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot

    def find_available_hosts_and_slots(self):
        """``{host: slots}`` of the live nodes with at least one slot."""
        out = {}
        for name, node in ray_nodes().items():
            resources = node.get("Resources", {})
            slots = (resources.get("CPU", 0) // self.cpus_per_slot if self.cpus_per_slot
                     else math.inf)
            if self.use_gpu:
                slots = min(slots, resources.get("GPU", 0) // (self.gpus_per_slot or 1))
            if slots and slots != math.inf:
                out[name] = int(slots)
        return out


def ray_nodes():
    """``{host name: node}`` of Ray's live nodes: a node by its address, or
    ``address-<node id prefix>`` where several nodes share one."""
    import ray
    nodes = [n for n in ray.nodes() if n.get("Alive", n.get("alive"))]
    count = {}
    for n in nodes:
        count[n["NodeManagerAddress"]] = count.get(n["NodeManagerAddress"], 0) + 1
    return {(n["NodeManagerAddress"] if count[n["NodeManagerAddress"]] == 1
             else f"{n['NodeManagerAddress']}-{n['NodeID'][:8]}"): n for n in nodes}


def actor_options(host):
    """The Ray actor options that put an actor on ``host``: the node of that name (address,
    ``address-<prefix>`` or node id), the node that has a ``node:<host>`` resource, or none
    (a logical host)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    nodes = ray_nodes()
    node = nodes.get(host) or next((n for n in nodes.values() if n["NodeID"] == host), None)
    if node is not None:
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"],
                                                                      soft=False)}
    if any(f"node:{host}" in n.get("Resources", {}) for n in nodes.values()):
        return {"resources": {f"node:{host}": 0.01}}
    return {}


class PolledDiscovery:
    """Calls the discovery with a deadline: the first failure is fatal, later ones are logged
    and the hosts found before are kept (as ``hora run``'s discovery script)."""

    def __init__(self, discovery, timeout_s=DISCOVERY_TIMEOUT_S):
        find = getattr(discovery, "find_available_hosts_and_slots", discovery)
        if not callable(find):
            raise TypeError(f"ElasticRayExecutor: settings.discovery must have "
                            f"find_available_hosts_and_slots() or be callable, got "
                            f"{discovery!r}")
        self.discovery = discovery
        self._find = find
        self._timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "hora-ray-discovery")
        self._pending = None
        self.hosts = None           # the last good answer: HostSpecs

    def poll(self):
        """Ask the discovery; return its hosts (the last good ones when this answer failed or
        is late)."""
        if self._pending is None:
            self._pending = self._pool.submit(self._find)
        try:
            found = self._pending.result(timeout=self._timeout_s)
            hosts = host_specs(found)
        except concurrent.futures.TimeoutError:
            return self._failed(f"no answer within {self._timeout_s:g} s", keep_pending=True)
        except Exception as e:  # noqa: BLE001 - a user's discovery may raise anything
            self._pending = None
            return self._failed(f"{type(e).__name__}: {e}", cause=e)
        self._pending = None
        self.hosts = hosts
        return hosts

    def _failed(self, why, cause=None, keep_pending=False):
        message = f"ElasticRayExecutor: discovery {self.discovery!r}: {why}"
        if not keep_pending:
            self._pending = None
        if self.hosts is None:
            raise HoraError(message) from cause
        log.warning("%s; keeping the hosts found before", message)
        return self.hosts

    def close(self):
        self._pool.shutdown(wait=False)


def host_specs(found):
    """HostSpecs of a discovery's answer: ``{host: slots}`` (or ``(host, slots)`` pairs);
    hosts without a slot are left out."""
    items = found.items() if hasattr(found, "items") else found
    specs = []
    for host, slots in items:
        if not isinstance(host, str) or not host or isinstance(slots, bool) or \
                not isinstance(slots, int) or slots < 0:
            raise ValueError(f"expected {{host: slots}}, got {host!r}: {slots!r}")
        if slots:
            specs.append(HostSpec(host, slots))
    return specs
