"""The record CRC the native update computes in its own pass (optim._update_mixed_native ->
partition.record_digest) is exactly the CRC32C of the record's bytes [0, record_bytes)
that SwapStore.write seals: checked on every write of real offloaded runs, for fp32, bf16
and fp16 models, fp32 and bf16 state, amsgrad, ragged segments, parameters without a
gradient in a step, NVMe partitions and crash-consistent host partitions."""

from __future__ import annotations

import pytest
import torch

import tiermem
import tiermem.swap.store
from tiermem.kernels.checksum import crc32c_portable
from tiermem.swap.integrity import seal as real_seal


@pytest.fixture
def sealed(monkeypatch):
    """Every seal() of the run: (partition, fused digest or None); a fused digest that is
    not the plain CRC32C of the record fails the test at once."""
    seen = []

    def checked_seal(buf, nbytes, partition, generation, *, digest=None):
        if digest is not None:
            plain = crc32c_portable(buf[:nbytes].numpy().tobytes())
            assert digest == plain, (f"partition {partition}: fused digest {digest:#010x}, "
                                     f"record CRC32C {plain:#010x}")
        seen.append((partition, digest))
        real_seal(buf, nbytes, partition, generation, digest=digest)

    monkeypatch.setattr(tiermem.swap.store, "seal", checked_seal)
    return seen


class Ragged(torch.nn.Module):
    """Odd sizes (segments end mid-page, bf16 kinds mid-page) and a parameter that gets no
    gradient on odd steps."""

    def __init__(self, dtype):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(7 * 1024 + 1000, dtype=dtype))
        self.b = torch.nn.Parameter(torch.randn(2048 + 3, dtype=dtype))
        self.c = torch.nn.Parameter(torch.randn(11 * 1024 + 11, dtype=dtype))
        self.unused = torch.nn.Parameter(torch.randn(1500, dtype=dtype))


def _run(tmp_path, *, dtype, state, amsgrad, crash=False, steps=3, kernel="native",
         rounding="nearest", master="fp32"):
    torch.manual_seed(0)
    model = Ragged(dtype)
    opt = torch.optim.AdamW(model.parameters(), amsgrad=amsgrad, weight_decay=0.1)
    cfg = {"swap": {"paths": [str(tmp_path)], "checksums": True},
           "tiers": {"host": {"capacity": "96KiB" if crash else 0}},
           "optimizer": {"kernel": kernel, "state_dtype": state, "state_rounding": rounding,
                         "master_weights": master},
           "pipeline": {"partition_size": "64KiB", "buffer_count": 3, "prefetch_depth": 1,
                        "zigzag": False}}
    if crash:
        cfg["swap"]["durability"] = "crash_consistent"
    with tiermem.offload(opt, cfg) as tm:
        tm.discard()
        for step in range(steps):
            loss = (model.a.float().square().sum() + model.b.float().sin().sum()
                    + model.c.float().cos().sum())
            if step % 2:
                loss = loss + model.unused.float().square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        tiers = tm.offloaded.tiers
        return {p.tier for p in tiers.parts}, len(tiers.parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state", ["fp32", "bf16"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_digest_is_the_crc_of_the_record(tmp_path, sealed, dtype, state, amsgrad):
    tiers, nparts = _run(tmp_path, dtype=dtype, state=state, amsgrad=amsgrad)
    assert tiers == {"nvme"} and nparts >= 2
    fused = [d for _, d in sealed if d is not None]
    # every update wrote its record with the digest of its own pass (the step with no
    # gradient for `unused` too: its segments were hashed directly)
    assert len(fused) == len(sealed) and len(fused) >= 2 * nparts


def test_stochastic_rounding_and_crash_consistent_host_records(tmp_path, sealed):
    tiers, _ = _run(tmp_path, dtype=torch.bfloat16, state="bf16", amsgrad=True, crash=True,
                    rounding="stochastic")
    assert tiers == {"host", "nvme"}
    assert sum(d is not None for _, d in sealed) >= 6


def test_torch_kernels_leave_the_hash_to_the_store(tmp_path, sealed):
    _run(tmp_path, dtype=torch.float32, state="fp32", amsgrad=False, kernel="fused")
    assert sealed and all(d is None for _, d in sealed)


@pytest.mark.parametrize("master", ["kahan", "none"])
@pytest.mark.parametrize("state", ["int8", "fp32", "bf16"])
def test_crash_consistent_records_with_the_bf16_weights(tmp_path, sealed, master, state):
    """int8, fp32 or bf16 moments, master_weights kahan/none, crash_consistent: the record's
    copy of the bf16 weights (kind "weight") is sealed with the kernel's CRC of the weights
    it wrote."""
    tiers, _ = _run(tmp_path, dtype=torch.bfloat16, state=state, amsgrad=False, crash=True,
                    rounding="stochastic", master=master)
    assert tiers == {"host", "nvme"}
    assert sum(d is not None for _, d in sealed) >= 6
