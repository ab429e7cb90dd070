"""pipeline.overlap_backward's run-ahead: after step() the worker reads the next step's
first records into every buffer, but with one I/O queue's worth of reads in flight at a
time (io.queue_depth x io.block_size), so a read someone waits for meanwhile (a forward's
weights with parameters.offload) is not queued behind the whole fill.
"""

from __future__ import annotations

import pytest
import torch

import tiermem
from offload_helpers import Synthetic, backend_params, loss_of, make_batches, twin
from test_overlap import overlap_config

BUFFERS = 6


def _counting_reads(pipeline, overlap):
    """Wrap the store's read and the worker's run-ahead: for each read the run-ahead issues,
    how many of its earlier reads were still in flight; and, in `held`, the partitions
    already in a buffer when the run-ahead began (it has no read to issue for those)."""
    fill: list = []
    seen: list[int] = []
    held: set[int] = set()
    active = [False]
    real_read, real_run_ahead = pipeline.store.read, overlap._run_ahead

    def read(part, buf, **kw):
        req = real_read(part, buf, **kw)
        if active[0]:
            seen.append(sum(not r.done() for r in fill))
            fill.append(req)
        return req

    def run_ahead():
        held.clear()
        held.update(pipeline.where)
        fill.clear()
        active[0] = True
        try:
            real_run_ahead()
        finally:
            active[0] = False

    pipeline.store.read = read
    overlap._run_ahead = run_ahead
    return seen, held


@pytest.mark.parametrize("queue_depth, in_flight", [(4, 1), (8, 2)])
@pytest.mark.parametrize("backend", backend_params())
def test_run_ahead_fills_every_buffer_a_queue_at_a_time(tmp_path, backend, queue_depth,
                                                        in_flight):
    model = Synthetic()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cfg = overlap_config(tmp_path, backend=backend, host=0, buffer_count=BUFFERS,
                         prefetch_depth=2, queue_depth=queue_depth, block_size="16KiB")
    with tiermem.offload(opt, cfg) as tm:
        pipeline, overlap = tm.offloaded.tiers.pipeline, tm.offloaded.overlap
        record = pipeline.slots[0].buf.numel()
        assert queue_depth * 16384 // record == in_flight  # 64 KiB records, no footer
        assert len(tm.offloaded.parts) >= 2 * BUFFERS  # the fill reads all it takes in
        seen, held = _counting_reads(pipeline, overlap)
        reads = 0
        for step, micro in enumerate(make_batches(model, 3)):
            for tokens, target in micro:
                loss_of(model, tokens, target, True).backward()
            seen.clear()
            opt.step()
            overlap.wait_idle()
            planned = [p.id for p in pipeline.planned]
            # every buffer holds one of the next step's first records, read by the fill
            assert sorted(pipeline.where, key=planned.index) == planned[:BUFFERS]
            # a record the step's last visits left in a buffer (the worker's order during
            # backward follows the gradients, not the plan) needs no read
            first = set(planned[:BUFFERS])
            assert len(seen) == BUFFERS - len(first & held), (step, seen, held)
            assert max(seen, default=0) < in_flight, seen
            reads += len(seen)
            opt.zero_grad()
        assert reads >= BUFFERS  # the queue-at-a-time bound was checked on real fills


def test_run_ahead_cut_short_by_backward(tmp_path):
    """With no pause between step() and the next backward, the fill is still waiting for
    reads when backward queues its first partition, and gives way to it there: the steps
    stay bitwise those of the plain optimizer."""
    model, ref = twin(Synthetic)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    batches = make_batches(model, 4)
    cfg = overlap_config(tmp_path, host=0, buffer_count=BUFFERS, prefetch_depth=2,
                         queue_depth=4, block_size="16KiB")
    with tiermem.offload(opt, cfg):
        for micro in batches:  # no wait between step() and backward: the fill is cut short
            for tokens, target in micro:
                loss_of(model, tokens, target, True).backward()
            opt.step()
            opt.zero_grad()
    for micro in batches:
        for tokens, target in micro:
            loss_of(ref, tokens, target, True).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)
