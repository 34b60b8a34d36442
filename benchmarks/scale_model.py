"""The control plane beyond this machine: messages and bytes a training step costs rank 0 and
a host leader, for jobs of up to thousands of ranks, from hora's own negotiation code run in
one process.

    python benchmarks/scale_model.py                       # N = 8 .. 4,096, hosts of 8
    python benchmarks/scale_model.py --compare /tmp/s.json # beside scale.py --hosts-of 8 runs

No process is started and no socket opened: the ranks are simulated, the logic is the real one.
Rank 0's :class:`~hora.core.negotiation.Coordinator` (with its response cache) and
:class:`~hora.core.engine.small.SmallReductions`, and each host leader's
:class:`~hora.core.engine.relay.HostDesk`, take the messages every rank's engine would send in
a training step of 100 named gradients (``_scale_jobs.GRAD_FLOATS``: 1 KiB .. 64 KiB, the
small ones with their inputs); each message is framed as on the wire
(:func:`hora.core.engine.conn.frame`) to count its bytes.  The ranks are in hosts of
``--hosts-of`` (rank 0's host's ranks speak to rank 0 directly, the others through their
leader, and the leaders to rank 0 or, beyond ``--fanout`` + 1 hosts, to a leader above them,
as :func:`hora.core.links.ctrl_parents` connects them).

The timing is the one thing modelled: each rank sends its step in ``--batches`` requests (the
engine sends what was submitted each cycle; ``scale.py`` measures how many a worker sends a
step, which ``--compare`` takes for each N it measured), cut at points of its own, each
arriving at a random moment of its batch's round; a leader and rank 0 take each message as it
comes (an engine step each), and rank 0 sends its responses from each step that completed
collectives.  Steps are repeated until the response cache holds every gradient, then one step
is counted.

Prints a table: for each N, messages (and KiB) a step received and sent by rank 0 and by the
busiest leader, and rank 0's CPU for the step in this process; with ``--compare``, the measured
counts (messages and bytes) of ``scale.py --hosts-of`` at the same N beside the model's, and
their ratios.  Then a second table for the same gradients reduced as one grouped allreduce a
step: each rank sends one request a step, so timing has no say in the counts, and with
``--compare`` the model's are beside the run's, at rank 0 and at the busiest leader.
"""
import argparse
import json
import random
import sys
import time

import numpy as np

import _scale_jobs as jobs     # the benchmarks folder is sys.path[0]
from hora.core.engine.conn import frame
from hora.core.engine.relay import HostDesk
from hora.core.engine.small import SmallReductions, small
from hora.core.links import CTRL_FANOUT, ctrl_below, ctrl_parents, ctrl_routes
from hora.core.messages import ALLREDUCE, Request, Sum
from hora.core.negotiation import Coordinator
from hora.core.wire import Fwd, HostIds, Req, Resp

NP = (8, 16, 32, 64, 256, 1024, 4096)
WARM_STEPS = 3          # steps before the counted one: the cache holds every gradient by then


def _requests(grouped=False):
    """A step's requests: one a gradient, or one for them all (a grouped allreduce)."""
    if grouped:
        shapes = tuple((n,) for n in jobs.GRAD_FLOATS)
        return [Request(jobs.GROUP_NAME, ALLREDUCE, "<f4", shapes, Sum, -1, 1.0, 1.0, None)]
    return [Request(f"grad.{i}", ALLREDUCE, "<f4", ((n,),), Sum, -1, 1.0, 1.0, None)
            for i, n in enumerate(jobs.GRAD_FLOATS)]


class _Count:
    def __init__(self, rank=None):
        self.rank = rank
        self.received = self.received_bytes = self.sent = self.sent_bytes = 0

    def got(self, data, times=1):
        self.received += times
        self.received_bytes += times * len(data)

    def put(self, data, times=1):
        self.sent += times
        self.sent_bytes += times * len(data)


class Model:
    """A job of ``n`` ranks in hosts of ``per_host``, its control plane in one process."""

    def __init__(self, n, per_host, batches, fanout=CTRL_FANOUT, seed=0, grouped=False):
        self.n, self.batches = n, 1 if grouped else batches
        hosts = tuple(r // per_host for r in range(n))
        self.parent = parents = ctrl_parents(hosts, fanout)
        self.coord = Coordinator(n)
        self.small = SmallReductions(self.coord)
        self.children = {}
        for r in range(1, n):
            self.children.setdefault(parents[r], []).append(r)
        self.desks = {}                 # every leader's but rank 0's, as LeaderSide makes it
        for leader in self.children:
            if leader == 0:
                continue
            below = ctrl_below(ctrl_routes(leader, parents))
            self.desks[leader] = HostDesk(
                [leader, *(c for c in self.children[leader] if c not in below)], below=below)
        self.ids = {}                   # the cache: request -> id (every rank's the same)
        self.reqs = _requests(grouped)
        self.inputs = {q.name: np.zeros(q.shapes[0], np.float32).tobytes() for q in self.reqs}
        self.rng = random.Random(seed)
        self.pending = {}               # rank 0's own submitted requests, as its engine has them

    def _req(self, batch):
        """What every rank sends for ``batch`` of its step's requests (all ranks alike)."""
        ids = [self.ids.get(q) for q in batch]
        return Req([q for q, i in zip(batch, ids) if i is None],
                   {(0, q.name): self.inputs[q.name] for q in batch if small(q)},
                   [i for i in ids if i is not None], False)

    def step(self, rank0, leaders):
        """One training step: every rank sends its requests in ``batches`` messages, cut at
        points of its own, each at a random moment of its batch's round; leaders and rank 0
        take each message as it comes (an engine step each: the one that completes
        collectives sends their responses).  Counts into ``rank0`` and ``leaders``
        (``{leader: _Count}``); returns rank 0's CPU seconds in its steps."""
        arrivals, count = [], len(self.reqs)
        for r in range(self.n):
            cuts = [0, *sorted(self.rng.sample(range(1, count), self.batches - 1)), count]
            for b in range(self.batches):
                arrivals.append((b + self.rng.random(), r, self.reqs[cuts[b]:cuts[b + 1]]))
        arrivals.sort(key=lambda a: a[0])
        cpu = 0.0
        for _, r, batch in arrivals:
            msg = self._req(batch)
            if r == 0:
                for q in batch:
                    self.pending[(0, q.name)] = (q, [np.zeros(q.shapes[0], np.float32)], None)
                up = [(0, msg)]
            elif r in self.desks:           # a leader's own requests go through its desk
                up = self._up(r, self.desks[r].request(r, msg, 0.0), leaders)
            else:
                up = self._send(r, [msg], leaders)
            if up:
                t0 = time.process_time()
                responses = self._rank0(up, rank0)
                cpu += time.process_time() - t0
                self._answer(responses, rank0, leaders)
        return cpu

    def _send(self, rank, messages, leaders):
        """``rank`` sends ``messages`` to its parent; returns what reaches rank 0 now, as
        ``[(the rank 0 heard it from, message)]``."""
        parent = self.parent[rank]
        if parent == 0:
            return [(rank, m) for m in messages]
        desk, now, out = self.desks[parent], 0.0, []
        for m in messages:
            leaders[parent].got(frame(m))
            cls = m.__class__
            out += (desk.host(rank, m, now) if cls is HostIds else
                    desk.forwarded(rank, m) if cls is Fwd else desk.request(rank, m, now))
        return self._up(parent, out, leaders)

    def _up(self, leader, messages, leaders):
        """``leader`` sends its parent what its desk made."""
        for m in messages:
            leaders[leader].put(frame(m))
        return self._send(leader, messages, leaders) if messages else []

    def _answer(self, responses, rank0, leaders):
        """Rank 0 sends ``responses`` to every connection it holds; leaders pass them on."""
        if not responses:
            return
        resp = frame(Resp(responses))
        rank0.put(resp, len(self.children[0]))
        for leader, desk in self.desks.items():
            leaders[leader].got(resp)
            leaders[leader].put(resp, len(self.children[leader]))
            desk.heard(responses)
        for r in responses:
            if r.tag == "cache":
                self.ids[r.request] = r.cache_id

    def _rank0(self, messages, count):
        """Rank 0's engine step: ``messages`` (its own requests, or what it read)."""
        coord = self.coord
        for sender, msg in messages:
            tag = msg.tag
            if sender != 0:
                count.got(frame(msg))
            if tag == "hids":
                self.small.take_host(msg.ranks, msg.small, msg.ids)
                coord.submit_host(msg.ranks, msg.ids, 0.0)
                continue
            if tag == "fwd":
                sender, msg = msg.src, msg.body
            if sender != 0:
                self.small.take(sender, msg.full, msg.small, msg.ids)
            coord.submit(sender, msg.full, 0.0, msg.ids)
        return [self.small.settle(r, self.pending) for r in coord.take_responses()]


def model(n, per_host, batches, fanout=CTRL_FANOUT, grouped=False):
    """The counted step of a job of ``n`` ranks: ``{"rank0": ..., "leader": ..., "cpu0_ms",
    "hosts", "depth"}`` (message and byte counts a step; ``leader``: the leader that
    received the most, or None).  ``grouped``: the step's gradients are one grouped
    allreduce, which each rank sends in one request."""
    m = Model(n, per_host, batches, fanout, grouped=grouped)
    for _ in range(WARM_STEPS):
        m.step(_Count(), {r: _Count(r) for r in m.desks})
    rank0, leaders = _Count(0), {r: _Count(r) for r in m.desks}
    cpu = m.step(rank0, leaders)
    busiest = max(leaders.values(), key=lambda c: c.received, default=None)
    depth = max((_depth(m.parent, r) for r in range(n)), default=0)
    return {"rank0": vars(rank0), "leader": vars(busiest) if busiest else None,
            "cpu0_ms": cpu * 1e3, "hosts": -(-n // per_host), "depth": depth}


def _depth(parents, rank):
    """Control connections from ``rank`` to rank 0."""
    hops = 0
    while rank:
        rank, hops = parents[rank], hops + 1
    return hops


def _measured(path):
    """``{n: {"rank0": {...}, "leader": {...}, "batches": ...}}`` from a scale.py JSON."""
    with open(path) as f:
        record = json.load(f)
    return {int(n): {**m["control"], "runs": m.get("control_runs") or [m["control"]]}
            for n, m in record["results"].get("hora", {}).items() if "control" in m}


_KEYS = ("received", "sent", "received_bytes", "sent_bytes")


def _ratios(runs, modelled, side):
    """Each run's counts of ``side`` (messages and bytes) over the model's."""
    return [{side: {k: r[side][k] / max(modelled[k], 1) for k in _KEYS}} for r in runs]


def _scaled(runs, side, unit):
    """``runs`` with ``side``'s byte counts in ``unit`` bytes."""
    return [{side: {k: r[side][k] / unit for k in ("received_bytes", "sent_bytes")}}
            for r in runs]


def _spread(runs, side, key, digits=1):
    """What ``runs`` measured of ``side``'s ``key``: the one value, or ``lo-hi`` over the
    repeats."""
    got = sorted(r[side][key] for r in runs)
    lo, hi = f"{got[0]:.{digits}f}", f"{got[-1]:.{digits}f}"
    return lo if len(got) == 1 else f"{lo}-{hi}"


def _pair(runs, side, keys, digits):
    return " / ".join(_spread(runs, side, k, digits) for k in keys)


def _beside(runs, modelled, side, unit=1024):
    """Four cells: ``runs``' messages of ``side`` in / out, their ratios to ``modelled``,
    the same for bytes (in ``unit`` bytes)."""
    ratios, sized = _ratios(runs, modelled, side), _scaled(runs, side, unit)
    return [_pair(runs, side, _KEYS[:2], 1), _pair(ratios, side, _KEYS[:2], 2),
            _pair(sized, side, _KEYS[2:], 0), _pair(ratios, side, _KEYS[2:], 2)]


def _counts(c, unit=1024):
    """A model's count: messages in / out, bytes (in ``unit`` bytes) in / out."""
    return [f"{c['received']} / {c['sent']}",
            f"{c['received_bytes'] / unit:.0f} / {c['sent_bytes'] / unit:.0f}"]


def _grouped_table(args, measured):
    """The grouped step (one request a rank a step), beside the runs that measured it."""
    print(f"\nThe same gradients as one grouped allreduce a step (one request a rank, "
          f"{args.hosts_of} ranks a host):")
    print("| N | rank 0: model msgs in / out | model bytes in / out | measured msgs | measured "
          "/ model | measured bytes | measured / model (bytes) | busiest leader: model msgs · "
          "bytes | measured msgs | measured / model | measured bytes | measured / model "
          "(bytes) |")
    print("|---:|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.np:
        got = model(n, args.hosts_of, 1, args.fanout, grouped=True)
        runs = [r["grouped"] for r in measured.get(n, {}).get("runs", ())
                if (r.get("grouped") or {}).get("rank0")]
        cells = [str(n), *_counts(got["rank0"], 1)]
        cells += _beside(runs, got["rank0"], "rank0", 1) if runs else ["–"] * 4
        if not got["leader"]:
            cells += ["–"] * 5
        elif runs and all(r.get("leader") for r in runs):
            cells += [" · ".join(_counts(got["leader"], 1)),
                      *_beside(runs, got["leader"], "leader", 1)]
        else:
            cells += [" · ".join(_counts(got["leader"], 1)), *["–"] * 4]
        print("| " + " | ".join(cells) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, nargs="+", default=list(NP))
    parser.add_argument("--hosts-of", type=int, default=8)
    parser.add_argument("--fanout", type=int, default=CTRL_FANOUT,
                        help="leaders below a leader (HORA_CONTROL_FANOUT)")
    parser.add_argument("--batches", type=float, default=None,
                        help="requests a rank sends a step (default: what --compare's run "
                             "measured at that N, else at its smallest N with more than one "
                             "host, else 1)")
    parser.add_argument("--compare", metavar="JSON", help="a scale.py --hosts-of run's record")
    args = parser.parse_args()
    measured = _measured(args.compare) if args.compare else {}
    multi = [n for n in sorted(measured) if n > args.hosts_of]
    default = args.batches or (measured[multi[0]]["batches"] if multi else 1)

    def batches(n):
        got = args.batches or measured.get(n, {}).get("batches") or default
        return max(1, round(got))
    print(f"hosts of {args.hosts_of}; {len(jobs.GRAD_FLOATS)} gradients a step; "
          f"{args.fanout} leaders below a leader")
    print("| N | hosts | tree depth | requests a rank | rank 0: msgs in / out | rank 0: KiB in "
          "/ out | busiest leader: msgs in / out | its KiB in / out | rank 0 CPU ms (model) | "
          "measured rank 0 msgs in / out | measured / model | measured rank 0 KiB in / out | "
          "measured / model (KiB) |")
    print("|---:|---:|---:|---:|---|---|---|---|---:|---|---|---|---|")
    for n in args.np:
        got = model(n, args.hosts_of, batches(n), args.fanout)
        r0, ld = got["rank0"], got["leader"]
        cells = [str(n), str(got["hosts"]), str(got["depth"]), str(batches(n)), *_counts(r0),
                 *(_counts(ld) if ld else ["–", "–"]), f"{got['cpu0_ms']:.1f}"]
        real = measured.get(n)
        cells += _beside(real["runs"], r0, "rank0") if real else ["–"] * 4
        print("| " + " | ".join(cells) + " |")
    _grouped_table(args, measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
