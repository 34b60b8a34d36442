"""hora.torch.distributed without processes: importing hora.torch registers the backend
"hora"; under hora's placement torch's env:// gets RANK and WORLD_SIZE (never over the
user's); a reduce op hora has not is refused by name."""
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def test_importing_hora_torch_registers_the_backend():
    import hora.torch  # noqa: F401
    assert "HORA" in dist.Backend._plugins
    assert dist.Backend("hora") == "hora"


def test_torch_env_placement_comes_from_hora_s_where_unset():
    from hora.torch.distributed import register
    env = {"HORA_RANK": "3", "HORA_SIZE": "4", "HORA_LOCAL_RANK": "1", "HORA_LOCAL_SIZE": "2"}
    register(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "3", "4", "1", "2")
    mine = {"HORA_RANK": "3", "HORA_SIZE": "4", "RANK": "0", "WORLD_SIZE": "1"}
    register(mine)
    assert (mine["RANK"], mine["WORLD_SIZE"]) == ("0", "1")
    bare = {}
    register(bare)
    assert bare == {}


def test_a_reduce_op_hora_has_not_is_refused_by_name():
    from hora.errors import HoraError
    from hora.torch.distributed import _op
    import hora.torch as hvd
    assert _op(dist.ReduceOp.AVG, "allreduce") == hvd.Average
    assert _op(dist.AllreduceOptions().reduceOp, "allreduce") == hvd.Sum
    with pytest.raises(HoraError, match="allreduce: the hora backend has no reduce op BAND"):
        _op(dist.ReduceOp.BAND, "allreduce")


def test_under_torchrun_rank_0_tells_its_rendezvous_port_through_torch_s_store():
    """Rank 0 draws a free port and sets it in torch's store; another rank takes a port
    once something listens there, so the last attempt's port (torchrun's store outlives a
    restart) is read again until rank 0 of this attempt has set its own."""
    import socket
    import threading
    import time
    from types import SimpleNamespace
    from hora.torch.distributed import _agree_rendezvous_port

    store = dist.HashStore()
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    with socket.socket() as dead:                   # the last attempt's port: nothing there
        dead.bind(("127.0.0.1", 0))
        store.set("hora/rendezvous_port", str(dead.getsockname()[1]))
    listener = socket.socket()
    zero = dict(torchrun)

    def rank_0_arrives():
        time.sleep(0.3)
        _agree_rendezvous_port(SimpleNamespace(store=store, group_rank=0), zero)
        listener.bind(("127.0.0.1", int(zero["HORA_RENDEZVOUS_PORT"])))
        listener.listen()
    one = dict(torchrun, RANK="1")
    arrival = threading.Thread(target=rank_0_arrives)
    arrival.start()
    try:
        _agree_rendezvous_port(SimpleNamespace(store=store, group_rank=1), one)
    finally:
        arrival.join()
        listener.close()
    assert one["HORA_RENDEZVOUS_PORT"] == zero["HORA_RENDEZVOUS_PORT"]
    # hora's own placement, or a port the user chose: nothing to agree
    for env in ({**torchrun, "HORA_RENDEZVOUS_PORT": "1234"}, {"HORA_RANK": "0", **torchrun}):
        before = dict(env)
        _agree_rendezvous_port(SimpleNamespace(store=store, group_rank=0), env)
        assert env == before
