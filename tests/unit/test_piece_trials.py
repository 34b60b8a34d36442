"""The hierarchical plane's trials of piece sizes: the plan every rank follows alike."""
import numpy as np

from hora.backends.hierarchical import _PieceTrials


def test_rounds_take_turns_and_the_first_round_is_not_counted():
    trials = _PieceTrials((1, 2, 3), rounds=3)
    seen, last = [], False
    spent = {1: [9.0, 4.0, 5.0], 2: [9.0, 1.0, 1.5], 3: [0.1, 3.0, 3.0]}
    for k in range(9):
        c = trials.next()
        seen.append(c)
        last = trials.record(c, spent[c][k // 3])
        assert last == (k == 8)
    assert seen == [1, 2, 3] * 3
    # candidate 3 was fastest in the first round only (not counted): 2 wins
    np.testing.assert_array_equal(trials.times(), [9.0, 2.5, 6.0])
    assert trials.times().dtype == np.float64
