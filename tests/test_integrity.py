"""Checksummed, generation-numbered swap records: every way a record can go wrong on disk
is caught on read, named, and never fed into an update."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import tiermem
from hypothesis import given, settings, strategies as st

from tiermem.errors import TierMemIOError
from tiermem.io.buffers import aligned_empty
from tiermem.kernels.checksum import crc32c
from tiermem.swap import integrity
from tiermem.swap.integrity import FOOTER_BYTES, IntegrityError, check, hash_landing, seal


def _record(nbytes=8192, seed=0):
    buf = aligned_empty(nbytes + FOOTER_BYTES)
    buf[:nbytes].copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(seed)))
    return buf


class FakeLanding:
    """A read that lands `steps` bytes further each time it is looked at (landed / done),
    copying the file's bytes into the buffer only as they land: a byte hashed before its
    turn is the buffer's old garbage, and the CRC comes out wrong."""

    def __init__(self, buf, data, steps, fail=False):
        self.buf, self.data, self.steps, self.fail = buf, data, list(steps), fail
        self.at = 0

    def _advance(self):
        step = self.steps.pop(0) if self.steps else len(self.data)
        new = min(len(self.data), self.at + step)
        self.buf[self.at:new].copy_(self.data[self.at:new])
        self.at = new

    @property
    def landed(self):
        self._advance()
        return self.at

    def done(self):
        self._advance()
        return self.at == len(self.data)

    def wait(self, timeout=None):
        while not self.done():
            pass
        if self.fail:
            raise TierMemIOError("read of the record failed", op="read", path="f")
        return len(self.data)


@settings(max_examples=60, deadline=None)
@given(nbytes=st.integers(1, 3 * integrity.HASH_STEP // 4096).map(lambda k: k * 4096),
       steps=st.lists(st.integers(0, 2 * integrity.HASH_STEP), max_size=12))
def test_a_record_hashed_as_it_lands(monkeypatch, nbytes, steps):
    """hash_landing gives the CRC32C of the whole record, hashing only what has landed,
    however the read's progress comes (no byte beyond the landed prefix is read: the fake
    read leaves garbage there until it lands)."""
    monkeypatch.setattr(integrity, "POLL", 0.0)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(nbytes))
    buf = torch.full((nbytes + 4096,), 0x5A, dtype=torch.uint8)
    got = hash_landing(buf, nbytes, FakeLanding(buf, data, steps))
    assert got == crc32c(data)


def test_the_landed_part_is_hashed_before_the_read_is_done(monkeypatch):
    """What has landed is hashed while the rest moves: once the read is done, only what
    landed last (under HASH_STEP) is left to hash."""
    monkeypatch.setattr(integrity, "POLL", 0.0)
    n, step = 4 * integrity.HASH_STEP, integrity.HASH_STEP
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    buf = torch.empty(n, dtype=torch.uint8)
    landing = FakeLanding(buf, data, [step // 2] * 64)
    hashed = []
    real = integrity.crc32c

    def spy(piece, crc=0, **kw):
        hashed.append((piece.numel(), landing.at))
        return real(piece, crc, **kw)
    monkeypatch.setattr(integrity, "crc32c", spy)
    assert hash_landing(buf, n, landing) == real(data)
    assert sum(k for k, _ in hashed) == n
    assert all(k >= step for k, at in hashed[:-1] if at < n)  # in HASH_STEP pieces or more
    assert hashed[-1][0] < step and len(hashed) >= 4


def test_a_read_that_fails_as_it_lands_raises_its_failure(monkeypatch):
    monkeypatch.setattr(integrity, "POLL", 0.0)
    n = 2 * integrity.HASH_STEP
    data = torch.zeros(n, dtype=torch.uint8)
    buf = torch.empty(n, dtype=torch.uint8)
    with pytest.raises(TierMemIOError, match="read of the record failed"):
        hash_landing(buf, n, FakeLanding(buf, data, [integrity.HASH_STEP] * 4, fail=True))


def test_seal_then_check_passes():
    buf = _record()
    seal(buf, 8192, partition=7, generation=3)
    check(buf, 8192, 7, 3, path="f", offset=0)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[100].add_(1), "checksum expected"),
    (lambda b: b[8192:8200].zero_(), "no record footer"),
])
def test_damaged_record(damage, message):
    buf = _record()
    seal(buf, 8192, partition=7, generation=3)
    damage(buf)
    with pytest.raises(IntegrityError, match=message) as info:
        check(buf, 8192, 7, 3, path="/swap/state.swap", offset=65536)
    assert "partition 7 in /swap/state.swap at offset 65536" in str(info.value)


def test_record_of_another_partition_or_an_older_generation():
    buf = _record()
    seal(buf, 8192, partition=7, generation=3)
    with pytest.raises(IntegrityError, match="partition id expected 8, found 7"):
        check(buf, 8192, 8, 3, path="f", offset=0)
    with pytest.raises(IntegrityError, match="generation expected 4, found 3 .*write was lost"):
        check(buf, 8192, 7, 4, path="f", offset=0)


# -- end to end ---------------------------------------------------------------------


def _cfg(tmp_path, checksums=True):
    # zigzag off and 3 buffers: every step reads every partition back from disk
    return {"swap": {"paths": [str(tmp_path)], "checksums": checksums},
            "tiers": {"host": {"capacity": 0}},
            "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 2,
                         "zigzag": False}}


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 256, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _slot(tm, part_index=5):
    """A partition past the first prefetch_depth + 1, which the end of a step reads ahead."""
    off = tm.offloaded
    part = [p for p in off.parts if p.tier == "nvme"][part_index]
    store = off.tiers.store
    s = store.slots[part.id]
    return part, store.files[s.file].path, s.offset, s.nbytes


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_a_flipped_byte_on_disk_stops_the_step(tmp_path, backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters())
    cfg = _cfg(tmp_path)
    cfg["io"] = {"backend": backend}
    with pytest.raises(tiermem.TierMemError, match="kept on disk") as outer:
        with tiermem.offload(opt, cfg) as tm:
            _train(model, opt, 2)
            tm.offloaded.tiers.flush()
            part, path, offset, _ = _slot(tm)
            with open(path, "r+b") as f:
                f.seek(offset + 10)
                byte = f.read(1)
                f.seek(offset + 10)
                f.write(bytes([byte[0] ^ 0x40]))
            with pytest.raises(IntegrityError) as info:
                _train(model, opt, 1)
            msg = str(info.value)
            assert f"partition {part.id} in {path} at offset {offset}" in msg
            assert "checksum expected" in msg
    # the exit could not gather that record back: everything stayed on disk
    assert os.path.exists(path) and os.path.exists(os.path.join(os.path.dirname(path),
                                                               "manifest.json"))
    assert isinstance(outer.value.__cause__, IntegrityError)


@contextlib.contextmanager
def _after_one_step(tmp_path):
    """(tm, model, opt) inside a discarded block, one step done and on disk."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    with tiermem.offload(opt, _cfg(tmp_path)) as tm:
        tm.discard()
        _train(model, opt, 1)
        tm.offloaded.tiers.flush()
        yield tm, model, opt


def test_an_older_copy_of_a_record_is_caught(tmp_path):
    """A lost write: the slot holds the record of an earlier step."""
    with _after_one_step(tmp_path) as (tm, model, opt):
        part, path, offset, nbytes = _slot(tm)
        with open(path, "rb") as f:
            f.seek(offset)
            old = f.read(nbytes)
        _train(model, opt, 1)
        tm.offloaded.tiers.flush()
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(old)
        with pytest.raises(IntegrityError, match="generation expected 2, found 1"):
            _train(model, opt, 1)


def test_a_truncated_swap_file_is_an_io_error(tmp_path):
    with _after_one_step(tmp_path) as (tm, model, opt):
        _, path, _, _ = _slot(tm)
        os.truncate(path, 4096)
        with pytest.raises(tiermem.TierMemIOError, match="past the end|end of file"):
            _train(model, opt, 1)


def test_checksums_off_writes_bare_records(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    with tiermem.offload(opt, _cfg(tmp_path, checksums=False)) as tm:
        _train(model, opt, 2)
        plan = tm.plan()
    assert plan["swap_bytes"] == plan["state_bytes"]["nvme"]
