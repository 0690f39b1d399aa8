"""Where a pull's packed copies land (pure): the layout both sides derive from one pull.

A decode rank that reads the prefill ranks' packed copies (`akv.packing`) into its staging
area, and a prefill rank that writes its own packed copy there in push mode, compute the same
thing from the same prepared pull (`akv.plan.Prepared`): the *items* (one per group,
component and prefill rank: where its bytes sit in the pull's staging range and which
tokens of which local blocks they fill) and, per prefill rank, the byte *runs* between its
packed copy and the staging range. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from akv.errors import TransferError
from akv.geometry.cache import CacheSpec
from akv.packing import ALIGN, Section, sections

if TYPE_CHECKING:
    from akv.plan import Prepared

__all__ = ["Item", "desc_rows", "plan_runs", "staged_bytes"]


@dataclass(frozen=True, slots=True)
class Item:
    """One (group, component, prefill rank) share of a pull: where it is staged and where its
    tokens go."""

    group: int
    component: int
    rank: int
    local_units: range
    remote_units: range
    first: int  # first token read, in the packed copy
    tokens: int
    offset: int  # in the pull's staging range
    nbytes: int
    blocks: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]


def plan_runs(
    local_spec: CacheSpec,
    remote_spec: CacheSpec,
    prepared: Prepared,
    prefill_tp: int,
    ranks: Collection[int],
    request_id: str,
) -> tuple[
    list[Item],
    dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]],
    dict[int, int],
]:
    """How a pull's packed copies land in its staging range, the same on both sides (the
    decode rank reads them, or a prefill rank writes its own in push mode): the items to
    scatter, and per prefill rank in ``ranks`` its runs (offset in the pull's staging range,
    offset in the rank's packed copy, bytes) and the size of its packed copy."""
    lc, rc, p = local_spec, remote_spec, prepared
    counts = list(p.remote_counts)
    layout: dict[int, dict[tuple[int, int], Section]] = {}
    sizes: dict[int, int] = {}
    for rank in ranks:
        secs, sizes[rank] = sections(rc, rank, prefill_tp, counts)
        layout[rank] = {(s.group, s.component): s for s in secs}
    gindex = {g.name: i for i, g in enumerate(lc.groups)}
    runs: dict[int, tuple[list[int], list[int], list[int]]] = {r: ([], [], []) for r in ranks}
    items: list[Item] = []
    at = 0
    for read in p.reads.detail:
        gi = gindex[read.group]
        ch = p.chunks[gi]
        if not ch.size or read.remote_rank not in layout:
            continue
        lg, rg = lc.groups[gi], rc.groups[gi]
        ci = next(i for i, c in enumerate(lg.components) if c.name == read.component)
        sec = layout[read.remote_rank][(gi, ci)]
        if lg.tokens:
            bl, br = lg.block_size, rg.block_size
            g = min(bl, br)
            pos0 = (
                ch.pattern.astype(np.int64) * g
                if ch.pattern is not None and bl > br
                else np.zeros(ch.size, np.int64)
            )
        else:
            g, pos0 = 1, np.zeros(ch.size, np.int64)
        tokens = ch.size * g
        blocks = np.repeat(ch.local.astype(np.int64), g)
        positions = np.repeat(pos0, g) + np.tile(np.arange(g, dtype=np.int64), ch.size)
        units = len(read.remote_units)
        nbytes = units * tokens * sec.layers * sec.run
        items.append(
            Item(
                gi,
                ci,
                read.remote_rank,
                read.local_units,
                read.remote_units,
                ch.offset,
                tokens,
                at,
                nbytes,
                blocks,
                positions,
            )
        )
        start = sec.offset + (read.remote_units.start - sec.units.start) * sec.unit_bytes
        if ch.offset + tokens > sec.tokens:
            raise TransferError(f"request {request_id!r}: tokens read lie outside the packed copy")
        local, remote, lengths = runs[read.remote_rank]
        if ch.offset == 0 and tokens == sec.tokens:
            local.append(at)
            remote.append(start)
            lengths.append(nbytes)
        else:  # a suffix of the tokens: one run per unit and layer
            run, layer = tokens * sec.run, sec.tokens * sec.run
            for k in range(units):
                for i in range(sec.layers):
                    local.append(at + (k * sec.layers + i) * run)
                    remote.append(start + k * sec.unit_bytes + i * layer + ch.offset * sec.run)
                    lengths.append(run)
        at += -(-nbytes // ALIGN) * ALIGN
    out = {
        r: (np.array(a, dtype=np.int64), np.array(b, dtype=np.int64), np.array(n, dtype=np.int64))
        for r, (a, b, n) in runs.items()
    }
    return items, out, sizes


def staged_bytes(items: Sequence[Item]) -> int:
    """Bytes of the staging range a pull's items take (each starts on an `ALIGN` boundary)."""
    return items[-1].offset + items[-1].nbytes if items else 0


def desc_rows(
    addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], device: int
) -> npt.NDArray[np.int64]:
    """``(addr, len, device)`` rows."""
    out = np.empty((len(addrs), 3), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2] = addrs, lengths, device
    return out
