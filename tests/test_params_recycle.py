"""Record buffers are reused only once nothing views them, and the cache stays bounded."""

from __future__ import annotations

import gc

from hypothesis import given, settings, strategies as st

from tiermem.params.recycle import Recycler

PAGE = 4096


def test_a_buffer_comes_back_only_when_its_last_view_dies():
    r = Recycler(limit=1 << 20)
    a = r.get(2 * PAGE)
    view = a[PAGE:].view(-1)  # a view outliving the buffer's own tensor
    ptr = a.data_ptr()
    del a
    gc.collect()
    b = r.get(2 * PAGE)
    assert b.data_ptr() != ptr  # still viewed: not handed out again
    view.fill_(7)
    del view
    gc.collect()
    c = r.get(2 * PAGE)
    assert c.data_ptr() == ptr and r.mapped == 2  # reused, not mapped afresh
    assert b.data_ptr() % PAGE == 0 and c.data_ptr() % PAGE == 0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.booleans()), min_size=1, max_size=40))
def test_buffers_in_use_are_distinct_and_the_cache_stays_under_the_limit(ops):
    """Random gets and drops: no two live buffers overlap, each keeps what was written
    into it, and cached + in-use bytes never exceed the limit by more than what is in
    use (a get above it maps afresh rather than fail)."""
    limit = 12 * PAGE
    r = Recycler(limit)
    live: list = []
    for pages, drop in ops:
        if drop and live:
            live.pop(0)  # refcounting returns it now: a buffer holds no cycle
        buf = r.get(pages * PAGE)
        buf.fill_(len(live) % 251)
        live.append((buf, len(live) % 251))
        spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b, _ in live)
        assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
        assert all(int(b.min()) == v == int(b.max()) for b, v in live)
        assert r.in_use == sum(b.numel() for b, _ in live)
        assert r.cached <= max(0, limit - r.in_use) + 8 * PAGE
    del buf
    live.clear()
    gc.collect()
    assert r.in_use == 0 and r.cached <= limit
    r.clear()
    assert r.cached == 0 and not r.free


def test_a_record_buffer_of_whole_huge_pages_starts_on_one():
    """A weight's buffer of 2 MiB or more starts on a 2 MiB boundary (huge pages over its
    whole extents, where the kernel has them: on 4 KiB pages the virtio disk moved the
    weights at half the rate); a smaller one is page-aligned and no bigger than asked."""
    r = Recycler(limit=64 << 20)
    big, odd, small = r.get(6_553_600), r.get((2 << 20) + PAGE), r.get(5 * PAGE)
    assert big.data_ptr() % (2 << 20) == 0 and odd.data_ptr() % (2 << 20) == 0
    assert small.data_ptr() % PAGE == 0
    assert [b.numel() for b in (big, odd, small)] == [6_553_600, (2 << 20) + PAGE, 5 * PAGE]
