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
