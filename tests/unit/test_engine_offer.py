"""The offer protocol, in process (no sockets): rank 0's desk and a worker's slot, driven by
a real Coordinator, message by message as the engine's two sides exchange them."""
from hora.core.engine.offer import MAX_BACKOFF, OfferDesk, OfferSlot, fits
from hora.core.messages import ALLREDUCE, Request, Sum
from hora.core.negotiation import Coordinator
from hora.core.wire import Accept, Bye, Offer, Req, Run


def ar(name, n=4):
    return Request(name, ALLREDUCE, "<f4", ((n,),), Sum, -1, 1.0, 1.0, None)


GRADS = [ar("g0"), ar("g1")]


def _cached(c, reqs):
    """Submit ``reqs`` on every rank twice, so that they are cached; their ids."""
    ids = {}
    for _ in range(2):
        for rank in range(c.size):
            c.submit(rank, reqs, now=0)
        ids.update((r.request, r.cache_id) for r in c.take_responses() if r.tag == "cache")
    return [ids[q] for q in reqs]


def _job(size=3):
    """A coordinator that has cached GRADS, rank 0's desk, and one slot per worker."""
    c = Coordinator(size, fusion_threshold=1 << 20)
    ids = _cached(c, GRADS)
    return c, ids, OfferDesk(c, range(1, size), min_bytes=0), {r: OfferSlot()
                                                               for r in range(1, size)}


def _request(desk, slot, rank, ids, offered=None):
    """Worker ``rank`` sends a Req for cached ``ids``; rank 0 reads it.  Returns the offer
    that was out (rank 0's view)."""
    offer = slot.withdraw()
    return desk.heard(rank, Req([], {}, list(ids), offer is not None if offered is None
                                else offered))


def test_the_last_rank_takes_the_offer_and_runs_what_its_request_would_have_yielded():
    c, ids, desk, slots = _job()
    c.submit(0, GRADS, now=0)
    _request(desk, slots[2], 2, ids)
    c.submit(2, [], now=0, cache_ids=ids)
    rank, offer = desk.make()
    assert rank == 1 and isinstance(offer, Offer) and offer.ids == tuple(ids)
    assert offer.heard == 0 and desk.out.rank == 1 and desk.out.number == offer.number == 1
    slots[1].received(offer)
    mine = slots[1].withdraw()
    assert mine is offer and fits(mine, ids + [None])          # it may send more after them
    out = desk.heard(1, Accept(offer.number, [], {}, []))
    assert out.number == offer.number and desk.out is None
    c.submit(1, [], now=0, cache_ids=list(out.ids))
    got = c.take_responses()
    assert got == list(offer.responses) == [Run(ALLREDUCE, 0, ("g0", "g1"))]


def test_an_offer_made_before_rank_0_read_the_workers_last_message_is_dropped():
    c, ids, desk, slots = _job(size=2)
    c.submit(0, GRADS, now=0)
    _, offer = desk.make()
    slot = slots[1]
    slot.withdraw()             # meanwhile the worker sent a request rank 0 had not read
    slot.received(offer)
    assert slot.withdraw() is None                  # its next message goes without it
    # rank 0 reads both messages; its next offer counts them, and is good
    assert desk.heard(1, Req([ar("other")], {}, [], False)).number == 1
    assert desk.heard(1, Req([ar("more")], {}, [], False)) is None and desk.out is None
    assert desk.make() is None                      # a late offer: this chance passes
    _, again = desk.make()
    assert again.heard == 2 and again.number == 2
    slot.received(again)
    assert slot.withdraw() is again


def test_no_second_offer_while_one_is_out_and_none_without_a_single_last_rank():
    c, ids, desk, _ = _job()
    assert desk.make() is None                       # nothing pending
    c.submit(0, GRADS, now=0)
    assert desk.make() is None                       # two workers missing
    c.submit(2, [], now=0, cache_ids=ids)
    assert desk.make() is not None
    assert desk.make() is None                       # one is out


def test_an_offer_that_does_not_fit_the_request_is_declined():
    _, ids, _, _ = _job()
    offer = Offer(1, 0, tuple(ids), ())
    assert fits(offer, ids) and fits(offer, ids + [7])
    assert not fits(offer, ids[::-1])                        # another order
    assert not fits(offer, ids[:1])                          # only part of them
    assert not fits(offer, [None] + ids)                     # something else first
    assert not fits(Offer(1, 0, (), ()), [])                 # an empty offer fits nothing


def test_an_offer_in_time_resets_the_backoff_taken_or_declined():
    c, ids, desk, _ = _job(size=2)
    c.submit(0, GRADS, now=0)
    passes = []
    for offered in (False, False, True, False, True):
        n = 0
        while desk.make() is None:
            n += 1
        passes.append(n)
        desk.heard(1, Req([], {}, [], offered))     # offered=False: the offer crossed it
    assert passes == [0, 1, 2, 0, 1]


def test_crossed_offers_double_the_passes_up_to_the_limit():
    c, ids, desk, _ = _job(size=2)
    c.submit(0, GRADS, now=0)
    passes = []
    for _ in range(9):
        n = 0
        while desk.make() is None:
            n += 1
        passes.append(n)
        desk.heard(1, Req([], {}, [], False))               # every offer crossed
    assert passes == [0, 1, 2, 4, 8, 16, 32, 64, MAX_BACKOFF]


def test_a_goodbye_withdraws_the_offer_as_crossed():
    c, ids, desk, slots = _job(size=2)
    c.submit(0, GRADS, now=0)
    _, offer = desk.make()
    slots[1].received(offer)
    assert slots[1].withdraw() is offer                 # the worker says goodbye instead
    assert desk.heard(1, Bye()).number == offer.number and desk.out is None
    assert desk.make() is None and desk.make() is not None      # backed off once


def test_small_allreduces_are_never_offered():
    from hora.core.engine.small import SMALL_ALLREDUCE
    c = Coordinator(2)
    small, large = [ar("s", 4)], [ar("l", SMALL_ALLREDUCE)]        # 16 B and 32 KiB
    _cached(c, small + large)
    desk = OfferDesk(c, [1], min_bytes=SMALL_ALLREDUCE)
    c.submit(0, small, now=0)
    assert desk.make() is None
    c.submit(1, small, now=0)
    c.take_responses()
    c.submit(0, large, now=0)
    assert desk.make()[0] == 1
