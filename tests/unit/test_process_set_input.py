"""A process set that names a rank twice is refused at once, on the rank that adds it, before
anything is sent: registered, it would wait for one more rank than it has."""
import pytest

from hora.core import process_sets


@pytest.mark.parametrize("add", [process_sets.add_process_set,
                                 process_sets.add_process_set_by_members])
def test_a_rank_named_twice_is_refused_before_anything_is_sent(add):
    ps = process_sets.ProcessSet([2, 0, 2, 1, 0])
    with pytest.raises(ValueError, match=r"\[0, 0, 1, 2, 2\] names 0, 2 more than once"):
        add(ps)       # (no hora.init(): the refusal needs no engine)
    assert ps.process_set_id is None
