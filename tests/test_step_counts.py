"""optim.counts.StepCounts against a list of floats doing the same: increments of every
parameter or of a subset, counts set from a checkpoint, parameters added, and the 0-d
views the rules take staying live as torch's own step tensors do."""

import numpy as np
from hypothesis import given, strategies as st

from tiermem.optim.counts import StepCounts

ops = st.lists(st.one_of(
    st.tuples(st.just("step"), st.sets(st.integers(0, 40))),
    st.tuples(st.just("set"), st.integers(0, 40), st.integers(0, 2**24)),
    st.tuples(st.just("extend"), st.integers(0, 3))), max_size=30)


@given(n=st.integers(0, 6), ops=ops)
def test_counts_follow_a_list_of_floats(n, ops):
    counts, ref = StepCounts([0.0] * n), [0.0] * n
    for op in ops:
        if op[0] == "step":
            mine = {i for i in op[1] if i < len(ref)}
            views = [counts[i] for i in range(len(ref))]  # as a rule holds them
            counts.increment(mine)
            for i in mine:
                # torch's own step is an fp32 tensor too: past 2**24 a step adds nothing
                ref[i] = float(np.float32(ref[i]) + np.float32(1))
            assert [float(v) for v in views] == ref  # live, like torch's in-place add
        elif op[0] == "set" and op[1] < len(ref):
            counts[op[1]] = float(op[2])
            ref[op[1]] = float(op[2])
        elif op[0] == "extend":
            counts.extend(op[1])
            ref.extend([0.0] * op[1])
        assert len(counts) == len(ref)
        assert counts.values() == ref
        assert [float(v) for v in counts] == ref
        assert all(v.dim() == 0 for v in counts)
