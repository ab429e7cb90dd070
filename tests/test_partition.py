"""Partitions: every element of every parameter is covered exactly once, in order; cuts
inside a parameter fall on multiples of CUT_ALIGN elements; each state tensor of a record
starts on a 4 KiB boundary; a partition never spans groups, layouts or forced tiers; and
assign_tiers fills the budgets in order. With bf16 state the moments take 2 bytes per
element (the master 4), and a record, padding included, still fits partition_size."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiermem.config import PlacementRule
from tiermem.tiers.placement import assign_tiers
from tiermem.partition import (CUT_ALIGN, RECORD_ALIGN, STATE_BYTES, Partition, Segment,
                               align_up, build_partitions, rule_tier,
                               state_kinds)

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_constants():
    assert CUT_ALIGN == 1024 and RECORD_ALIGN == 4096 and STATE_BYTES == 4


def test_state_kinds():
    f32, bf16 = torch.empty(3), torch.empty(3, dtype=torch.bfloat16)
    assert state_kinds(f32, False) == ("exp_avg", "exp_avg_sq")
    assert state_kinds(f32, True) == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert state_kinds(bf16, False) == ("master", "exp_avg", "exp_avg_sq")
    assert state_kinds(torch.empty(3, dtype=torch.float16), True)[0] == "master"


def test_split_example():
    """One fp32 param of 10000 elements, 64 KiB partitions (8 bytes of state per element,
    one page kept for the swap footer): 7168 elements, then the remaining 2832."""
    p = torch.empty(10000)
    parts = build_partitions([{"params": [p]}], {}, 64 << 10)
    assert [[(s.start, s.length) for s in q.segments] for q in parts] == [[(0, 7168)],
                                                                        [(7168, 2832)]]
    assert parts[0].offsets == {"exp_avg": 0, "exp_avg_sq": 28672}
    assert parts[0].record_bytes == 57344 <= (64 << 10) - RECORD_ALIGN
    assert parts[1].offsets == {"exp_avg": 0, "exp_avg_sq": align_up(2832 * 4)}
    assert parts[1].record_bytes == 2 * align_up(2832 * 4)


def test_small_params_share_a_partition_and_cut_on_alignment():
    ps = [torch.empty(100), torch.empty(3000), torch.empty(9000)]
    parts = build_partitions([{"params": ps}], {}, 64 << 10)  # 7168 elements per partition
    segs = [[(s.index, s.start, s.length) for s in q.segments] for q in parts]
    # 100 + 3000 fit; the third param starts in the same partition but is cut at 3072
    # elements (the largest multiple of 1024 that fits the 4068 elements of room)
    assert segs == [[(0, 0, 100), (1, 0, 3000), (2, 0, 3072)], [(2, 3072, 5928)]]


def test_split_example_bf16_state():
    """The same param with bf16 moments (4 bytes of state per element): 14336 elements per
    64 KiB partition, twice as many as with fp32 moments."""
    p = torch.empty(20000)
    parts = build_partitions([{"params": [p]}], {}, 64 << 10, state_dtype="bf16")
    assert [[(s.start, s.length) for s in q.segments] for q in parts] == [[(0, 14336)],
                                                                        [(14336, 5664)]]
    assert parts[0].offsets == {"exp_avg": 0, "exp_avg_sq": 28672}
    assert parts[0].record_bytes == 57344 <= (64 << 10) - RECORD_ALIGN
    assert parts[1].offsets == {"exp_avg": 0, "exp_avg_sq": align_up(5664 * 2)}


def test_bf16_capacity_counts_page_padding():
    """bf16 model with bf16 state: master 4 + two moments 2 = 8 bytes per element, but
    an odd multiple of 1024 elements leaves each bf16 kind 2 KiB short of a page. 76 KiB
    partitions: 72 KiB of room holds 9216 elements by the byte count, yet that record
    would be 36864 + 2 x 20480 = 77824 bytes, over the room; 8192 elements fit."""
    p = torch.empty(20000, dtype=torch.bfloat16)
    parts = build_partitions([{"params": [p]}], {}, 76 << 10, state_dtype="bf16")
    assert parts[0].numel == 8192
    assert parts[0].record_bytes == 8192 * 8
    assert all(q.record_bytes <= (76 << 10) - RECORD_ALIGN for q in parts)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_bf16_state_views(amsgrad):
    p = torch.empty(5000, dtype=torch.bfloat16)
    (part,) = build_partitions([{"params": [p], "amsgrad": amsgrad}], {}, 1 << 20,
                               state_dtype="bf16")
    rec = torch.zeros(part.record_bytes, dtype=torch.uint8)
    views = part.views(rec)
    expected = {"master": torch.float32, "exp_avg": torch.bfloat16,
                "exp_avg_sq": torch.bfloat16}
    if amsgrad:
        expected["max_exp_avg_sq"] = torch.bfloat16
    assert {k: v.dtype for k, v in views.items()} == expected
    for i, v in enumerate(views.values()):
        assert v.numel() == 5000
        v.fill_(i + 1)
    for i, (k, v) in enumerate(views.items()):
        assert bool((v == i + 1).all()), k


def test_views_are_disjoint_fp32_windows():
    p = torch.empty(5000, dtype=torch.bfloat16)
    (part,) = build_partitions([{"params": [p], "amsgrad": True}], {}, 1 << 20)
    rec = torch.zeros(part.record_bytes, dtype=torch.uint8)
    views = part.views(rec)
    assert list(views) == ["master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    for i, (k, v) in enumerate(views.items()):
        assert v.dtype == torch.float32 and v.numel() == 5000
        v.fill_(i + 1)
    for i, (k, v) in enumerate(views.items()):
        assert bool((v == i + 1).all()), k


def test_rule_tier_first_match_wins():
    rules = [PlacementRule("emb.*", "host"), PlacementRule("*.weight", "nvme"),
             PlacementRule("*", "gpu")]
    assert rule_tier("emb.weight", rules) == "host"
    assert rule_tier("fc.weight", rules) == "nvme"
    assert rule_tier("fc.bias", rules) == "gpu"
    assert rule_tier("", rules[:2]) is None  # no name: only a catch-all could apply
    assert rule_tier("", rules) == "gpu"
    assert rule_tier("x", []) is None


# -- property: build_partitions ----------------------------------------------------------------


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TIERS = ["gpu", "host", "nvme"]


@st.composite
def layouts(draw):
    n_groups = draw(st.integers(1, 4))
    groups, names, rules = [], {}, []
    k = 0
    for g in range(n_groups):
        params = []
        for _ in range(draw(st.integers(1, 6))):
            n = draw(st.one_of(st.integers(1, 5000), st.integers(5000, 70000),
                               st.sampled_from([1023, 1024, 1025, 2048, 8192, 8193])))
            p = torch.empty(n, dtype=draw(st.sampled_from(DTYPES)))
            if draw(st.booleans()):
                names[id(p)] = f"g{g}.p{k}"
            k += 1
            params.append(p)
        groups.append({"params": params, "amsgrad": draw(st.booleans())})
    for _ in range(draw(st.integers(0, 3))):
        rules.append(PlacementRule(f"g{draw(st.integers(0, 3))}.*", draw(st.sampled_from(TIERS))))
    size = draw(st.one_of(st.just(64 << 10), st.integers(16, 256).map(lambda x: x * 4096),
                          st.integers(1, 1 << 20)))  # also unaligned / below the minimum
    return (groups, names, rules, size, draw(st.integers(0, 50)), draw(st.integers(0, 50)),
            draw(st.sampled_from(["fp32", "bf16"])))


def elem_bytes(kind: str, state_dtype: str) -> int:
    return 4 if kind == "master" or state_dtype == "fp32" else 2


def record_bytes_of(numel: int, kinds, state_dtype: str) -> int:
    return sum(align_up(numel * elem_bytes(k, state_dtype)) for k in kinds)


def capacity(kinds, state_dtype: str, size: int) -> int:
    """The largest multiple of CUT_ALIGN whose record fits size less one page (or one
    CUT_ALIGN when none does)."""
    cap = CUT_ALIGN
    while record_bytes_of(cap + CUT_ALIGN, kinds, state_dtype) <= size - RECORD_ALIGN:
        cap += CUT_ALIGN
    return cap


@FAST
@given(layouts())
def test_build_partitions_invariants(layout):
    groups, names, rules, size, first_id, first_index, state_dtype = layout
    parts = build_partitions(groups, names, size, rules, first_id=first_id,
                             first_index=first_index, state_dtype=state_dtype)
    flat = [(g, p) for g, group in enumerate(groups) for p in group["params"]]
    assert [q.id for q in parts] == list(range(first_id, first_id + len(parts)))
    covered = {i: [] for i in range(len(flat))}
    last_group = 0
    for q in parts:
        assert q.segments, "empty partition"
        # groups in order, never mixed
        assert q.group >= last_group
        last_group = q.group
        group = groups[q.group]
        amsgrad = bool(group.get("amsgrad"))
        cap = capacity(q.kinds, state_dtype, size)
        assert 0 < q.numel == sum(s.length for s in q.segments) <= cap
        if q.numel > CUT_ALIGN:
            assert q.record_bytes <= size - RECORD_ALIGN
        for s in q.segments:
            i = s.index - first_index
            g, p = flat[i]
            assert p is s.param and g == q.group
            assert state_kinds(p, amsgrad) == q.kinds
            assert q.forced == rule_tier(names.get(id(p), ""), rules)
            assert s.length > 0
            covered[i].append((q.id, s.start, s.length))
        # record layout: each kind on a 4 KiB boundary, in order, no overlap
        off = 0
        assert list(q.offsets) == list(q.kinds)
        for kind in q.kinds:
            assert q.offsets[kind] % RECORD_ALIGN == 0
            assert q.offsets[kind] >= off
            off = q.offsets[kind] + q.numel * elem_bytes(kind, state_dtype)
        assert q.record_bytes == align_up(off) and q.record_bytes % RECORD_ALIGN == 0
        assert q.record_bytes == record_bytes_of(q.numel, q.kinds, state_dtype)
        assert {k: v.element_size() for k, v in q.views(
            torch.empty(q.record_bytes, dtype=torch.uint8)).items()} == {
                k: elem_bytes(k, state_dtype) for k in q.kinds}
    for i, segs in covered.items():
        p = flat[i][1]
        pos = 0
        ids = [pid for pid, _, _ in segs]
        assert ids == sorted(ids), f"param {i}: segments out of order"
        for _, start, length in segs:
            assert start == pos, f"param {i}: gap or overlap at {pos}"
            if start:
                assert start % CUT_ALIGN == 0, f"param {i}: cut at {start}"
            pos += length
        assert pos == p.numel(), f"param {i}: covers {pos} of {p.numel()}"
    # a param is cut only where its partition is full (to within one CUT_ALIGN chunk)
    by_id = {q.id: q for q in parts}
    for i, segs in covered.items():
        for (pid, start, length), _next in zip(segs, segs[1:]):
            q = by_id[pid]
            cap = capacity(q.kinds, state_dtype, size)
            assert q.numel > cap - CUT_ALIGN, f"param {i} cut in a partition with room"
    # segment indices follow the flattened parameter order
    idx = [s.index for q in parts for s in q.segments]
    assert idx == sorted(idx)


# -- assign_tiers -----------------------------------------------------------------------------


def _parts(sizes_forced):
    parts = []
    for i, (nbytes, forced) in enumerate(sizes_forced):
        q = Partition(i, 0, [Segment(torch.empty(1), i, 0, 1)], ("exp_avg",), forced=forced)
        q.record_bytes = nbytes
        parts.append(q)
    return parts


def _oracle(sizes_forced, gpu, host):
    left = {"gpu": gpu, "host": host}
    for nbytes, forced in sizes_forced:
        if forced in left:
            left[forced] -= nbytes
    if left["gpu"] < 0 or left["host"] < 0:
        return None
    out = []
    for nbytes, forced in sizes_forced:
        if forced is not None:
            out.append(forced)
            continue
        tier = "nvme"
        for t in ("gpu", "host"):
            if nbytes <= left[t]:
                left[t] -= nbytes
                tier = t
                break
        out.append(tier)
    return out


@FAST
@given(st.lists(st.tuples(st.integers(1, 64).map(lambda x: x * 4096),
                          st.sampled_from([None, None, None, "gpu", "host", "nvme"])),
                max_size=30),
       st.integers(0, 400).map(lambda x: x * 4096), st.integers(0, 400).map(lambda x: x * 4096))
def test_assign_tiers(sizes_forced, gpu, host):
    parts = _parts(sizes_forced)
    expected = _oracle(sizes_forced, gpu, host)
    if expected is None:
        with pytest.raises(ValueError, match=r"tiers\.(gpu|host)\.capacity"):
            assign_tiers(parts, gpu, host)
        return
    assign_tiers(parts, gpu, host)
    assert [q.tier for q in parts] == expected
    used = {t: sum(q.record_bytes for q in parts if q.tier == t) for t in TIERS}
    assert used["gpu"] <= gpu and used["host"] <= host
    for q, (_, forced) in zip(parts, sizes_forced):
        if forced is not None:
            assert q.tier == forced


def test_assign_tiers_first_fit_in_order():
    """A partition too big for what is left goes to NVMe; a later smaller one still fills
    the room."""
    parts = _parts([(8192, None), (16384, None), (4096, None), (4096, None)])
    assign_tiers(parts, 0, 12288)
    assert [q.tier for q in parts] == ["host", "nvme", "host", "nvme"]


def test_assign_tiers_forced_over_budget():
    parts = _parts([(8192, "host"), (8192, "host")])
    with pytest.raises(ValueError, match="tiers.host.capacity"):
        assign_tiers(parts, 0, 12288)
    parts = _parts([(8192, "gpu")])
    with pytest.raises(ValueError, match="tiers.gpu.capacity"):
        assign_tiers(parts, 4096, 1 << 30)


@FAST
@given(layouts=st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=20),
       sizes=st.lists(st.integers(1, 3000), min_size=20, max_size=20),
       by_layout=st.booleans())
def test_whole_parameter_partitions_by_layout(layouts, sizes, by_layout):
    """Whole parameters with alternating record layouts: each parameter in exactly one
    partition, never cut, with only its own layout, in parameter order within a partition,
    none past partition_size unless alone. In parameter order (by_layout False) a new
    partition starts at each change of layout; by layout, at most as many partitions as
    in order, and exactly one per layout while they fit."""
    from tiermem.partition import WholeLayout

    kinds = [WholeLayout(("m",), {}, {"m": torch.float32}),
             WholeLayout(("m", "v"), {}, {"m": torch.float32, "v": torch.float32}),
             WholeLayout(("m",), {}, {"m": torch.uint8})]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes[:len(layouts)]]
    whole = [[kinds[k] for k in layouts]]
    size = 64 << 10
    got = build_partitions([{"params": params}], {}, size, whole=whole, by_layout=by_layout)
    seen = [s.index for p in got for s in p.segments]
    assert sorted(seen) == list(range(len(params)))
    for p in got:
        idx = [s.index for s in p.segments]
        assert idx == sorted(idx)
        assert all(s.start == 0 and s.length == params[s.index].numel() for s in p.segments)
        assert {layouts[i] for i in idx} == {layouts[idx[0]]}
        assert p.kinds == kinds[layouts[idx[0]]].kinds
        assert p.record_bytes <= size - RECORD_ALIGN or len(idx) == 1
    in_order = build_partitions([{"params": params}], {}, size, whole=whole)
    changes = 1 + sum(a != b for a, b in zip(layouts, layouts[1:]))
    assert len(in_order) >= changes
    assert len(got) <= len(in_order)
    if by_layout and all(p.record_bytes < (size - RECORD_ALIGN) // 20 for p in got):
        assert len(got) == len(set(layouts))
