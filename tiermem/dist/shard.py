"""Each rank's share of the optimizer state under torch.distributed (ZeRO-style).

Every param group is flattened in parameter order, as partitions are, and its
element range is cut into `world` contiguous shares, share r going to rank r.
A cut that falls inside a parameter is moved down to a multiple of CUT_ALIGN
elements of that parameter, so torch's vectorised Adam kernels see the same
body/tail split on a piece as on the whole tensor (the bitwise parity that
partitions rely on). Shares are therefore uneven: by up to CUT_ALIGN - 1
elements at each cut, and a rank may own nothing of a small group.

Rules whose math spans a whole parameter (Adafactor's row and column statistics,
Muon's orthogonalisation) cut only between parameters (`whole=True`): each cut goes
to the parameter boundary nearest its even split, so a rank owns whole parameters
and shares are as uneven as the parameters are large.

A share is a list of Pieces: one contiguous slice of one flattened parameter,
at most one per parameter. A rank tiers its pieces exactly as a single process
tiers whole parameters (each piece is a 1-D view of its parameter), so
partitions, records and the pipeline do not know about ranks at all.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Iterator, Sequence

from tiermem.partition import CUT_ALIGN


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + length) of flattened parameter `index`, owned by one rank."""

    index: int  # the parameter's position in the optimizer's flattened order
    start: int  # first element, in the flattened parameter
    length: int
    offset: int  # where the piece begins in its rank's share of the group (elements)


def share_cuts(numels: Sequence[int], world: int, whole: bool = False) -> list[int]:
    """world + 1 cut points in a group's flattened range: share r is [cuts[r], cuts[r+1]).
    whole: every cut falls between two parameters."""
    starts = list(accumulate([0, *numels]))
    total = starts[-1]
    cuts = [0]
    for r in range(1, world):
        ideal = r * total // world
        i = bisect_right(starts, ideal) - 1  # the parameter holding element `ideal`
        if i >= len(numels):
            cuts.append(total)
            continue
        if whole:  # the nearer of the parameter's two ends
            cut = starts[i] if ideal - starts[i] <= starts[i + 1] - ideal else starts[i + 1]
        else:
            cut = starts[i] + (ideal - starts[i]) // CUT_ALIGN * CUT_ALIGN
        cuts.append(max(cut, cuts[-1]))
    cuts.append(total)
    return cuts


def pieces_in(numels: Sequence[int], first_index: int, lo: int, hi: int) -> list[Piece]:
    """The pieces of the parameters (flattened back to back) that fall in [lo, hi)."""
    out, pos = [], 0
    for j, n in enumerate(numels):
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append(Piece(first_index + j, a - pos, b - a, a - lo))
        pos += n
    return out


@dataclass
class GroupShares:
    """How one param group is split among the ranks."""

    group: int
    first_index: int  # flattened index of the group's first parameter
    numels: list[int]
    cuts: list[int]

    @property
    def world(self) -> int:
        return len(self.cuts) - 1

    def size(self, rank: int) -> int:
        return self.cuts[rank + 1] - self.cuts[rank]

    @property
    def widest(self) -> int:
        """The largest share: collectives pad every rank's share to it."""
        return max(self.size(r) for r in range(self.world))

    def pieces(self, rank: int) -> list[Piece]:
        return pieces_in(self.numels, self.first_index, self.cuts[rank], self.cuts[rank + 1])


def spans(pieces: Sequence[Piece], a: int, b: int) -> Iterator[tuple[int, int, int, int]]:
    """(param index, first element in the param, length, offset from a) of every piece's
    part inside share offsets [a, b): how a window of a share maps onto parameters."""
    for pc in pieces:
        lo, hi = max(a, pc.offset), min(b, pc.offset + pc.length)
        if lo < hi:
            yield pc.index, pc.start + lo - pc.offset, hi - lo, lo - a
