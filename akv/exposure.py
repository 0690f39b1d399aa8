"""Exposure records: what lets a decode rank prove that the blocks it read were still exposed
for its request when its reads completed (pure; numpy only).

Each prefill rank keeps a small *exposure table* in registered host memory: ``buckets``
buckets of ``SLOTS`` slots, a slot being three int64 words ``(token, digest, nblocks | generation << 32)``:

* ``token = hash47(request_id) << 16 | state`` (0: an empty slot), where ``state`` is
  :data:`EXPOSED` while the request is pinned and becomes :data:`RELEASED_READ`,
  :data:`RELEASED_EXPIRED` or :data:`RELEASED_CLOSED` *before* its blocks are handed back;
* ``digest`` and ``nblocks`` fingerprint the exposed block ids;
* ``generation`` (31 bits, never 0) tells this exposure of the request from any other one:
  a request id exposed again after a release, or by a restarted rank, gets another, so a
  reader bound to the generation it started under never accepts a later exposure.

A request lives in bucket ``hash47 % buckets``. After its data reads complete, a decode rank
reads that one bucket (one small READ, which also carries its "done" notice, so the prefill
rank cannot release before the bucket was read; on the prefill rank's host, loads of the
request's slot from the table in shared memory, :func:`shared_slot`, with the notice sent
after them) and checks it with :func:`verify`: success
needs a slot of its request in state EXPOSED with the digest of the block ids it was given.
No round trip through the prefill rank's event loop is involved.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from akv.errors import (
    ConfigError,
    LeaseExpiredError,
    NotExposedError,
    OutsideExposureError,
    ReexposedError,
    ReleasedError,
    UnsafeReadError,
)
from akv.shm import OfferedTable

__all__ = [
    "EXPOSED",
    "GENERATION_MASK",
    "PACKED",
    "RELEASED_CLOSED",
    "RELEASED_EXPIRED",
    "RELEASED_READ",
    "SLOTS",
    "SLOT_WORDS",
    "ExposureTable",
    "digest",
    "request_hash",
    "verify",
]

#: Slots per bucket (a bucket is what a decode rank reads: ``SLOTS * 24`` bytes).
SLOTS = 16
#: int64 words per slot: token, digest, nblocks.
SLOT_WORDS = 3
EXPOSED, RELEASED_READ, RELEASED_EXPIRED, RELEASED_CLOSED = 1, 2, 3, 4
#: Exposed through its packed copy only: the paged blocks went back to the engine after
#: packing (``release_after_pack``), so only a packed read may succeed (akv.packing).
PACKED = 5
#: The states of an exposure whose readers' "done" notices are awaited (see `live`).
LIVE = frozenset((EXPOSED, PACKED))
#: Generations are 31-bit (they share a word with the block count).
GENERATION_MASK = (1 << 31) - 1
_STATE_OF_REASON = {
    "read": RELEASED_READ,
    "pushed": RELEASED_READ,
    "expired": RELEASED_EXPIRED,
    "closed": RELEASED_CLOSED,
}


def request_hash(request_id: str) -> int:
    """A stable 47-bit, non-zero hash of a request id (so a token fits a signed int64)."""
    h = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=6).digest(), "little") >> 1
    return h or 1


def digest(block_ids: npt.NDArray[np.int32]) -> int:
    """A 63-bit fingerprint of a request's (whole) list of prefill block ids."""
    data = np.ascontiguousarray(block_ids, dtype=np.int32).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


class ExposureTable(OfferedTable):
    """The prefill side's table (the array is what gets registered with NIXL). ``shared``:
    kept in shared memory that decode ranks on this host may map (`akv.shm`; Linux only,
    elsewhere the table stays private)."""

    def __init__(self, buckets: int = 4096, *, shared: bool = False) -> None:
        if buckets < 1:
            raise ConfigError(f"exposure table buckets must be >= 1, got {buckets}")
        self.buckets = buckets
        super().__init__((buckets, SLOTS, SLOT_WORDS), shared=shared, name="akv-exposure")

    @property
    def bucket_bytes(self) -> int:
        """Bytes of one bucket (the size of a decode rank's check read)."""
        return SLOTS * SLOT_WORDS * 8

    def bucket_of(self, request_id: str) -> int:
        """The bucket a request lives in."""
        return request_hash(request_id) % self.buckets

    def publish(self, request_id: str, block_ids: npt.NDArray[np.int32], generation: int = 0) -> None:
        """Record an exposure (state EXPOSED). Raises :class:`ConfigError` if its bucket is full."""
        h = request_hash(request_id)
        rows = self.array[h % self.buckets]
        states = rows[:, 0] & 0xFFFF
        hashes = rows[:, 0] >> 16
        # Reuse this request's old slot, else an empty one, else the oldest released one.
        candidates = np.flatnonzero(hashes == h)
        if not candidates.size:
            candidates = np.flatnonzero(rows[:, 0] == 0)
        if not candidates.size:
            candidates = np.flatnonzero((states != EXPOSED) & (states != PACKED))
        if not candidates.size:
            raise ConfigError(
                f"exposure table bucket full ({SLOTS} requests exposed in it): "
                "raise the producer's max_exposed (exposure_buckets)"
            )
        slot = rows[candidates[0]]
        # Fingerprint first, token last: a reader never sees EXPOSED with a stale fingerprint.
        slot[0] = 0
        slot[1] = digest(block_ids)
        slot[2] = block_ids.size | (generation & GENERATION_MASK) << 32
        slot[0] = (h << 16) | EXPOSED

    def mark_packed(self, request_id: str) -> None:
        """Mark an exposure readable through its packed copy only (before its blocks go back)."""
        h = request_hash(request_id)
        rows = self.array[h % self.buckets]
        for i in np.flatnonzero(rows[:, 0] == (h << 16) | EXPOSED):
            rows[i, 0] = (h << 16) | PACKED

    def retire(self, request_id: str, reason: str) -> None:
        """Mark a request released (before its blocks go back to the engine)."""
        h = request_hash(request_id)
        rows = self.array[h % self.buckets]
        for i in np.flatnonzero((rows[:, 0] >> 16) == h):
            rows[i, 0] = (h << 16) | _STATE_OF_REASON[reason]


def _ids(read_ids: Sequence[int] | npt.NDArray[Any]) -> tuple[int, ...]:
    """The block ids an error names (built only on failure: the success path allocates nothing)."""
    return tuple(int(b) for b in read_ids)


def words(table: npt.NDArray[np.int64]) -> memoryview:
    """A table's (or one bucket's) int64 words as one flat, read-only view: what `shared_slot`
    loads from (each item read is one aligned 8-byte load). ``table`` must be C-contiguous."""
    if not table.flags.c_contiguous:
        raise ValueError("an exposure table's words must be contiguous")
    return memoryview(table).cast("B").cast("q")  # type: ignore[arg-type]  # numpy arrays are buffers


#: Words of one bucket (``base`` of bucket ``b`` in `shared_slot`: ``b * BUCKET_WORDS``).
BUCKET_WORDS = SLOTS * SLOT_WORDS


def shared_slot(table: memoryview, token_hash: int, base: int = 0) -> tuple[int, int, int] | None:
    """Read a request's slot straight from a table in shared memory (`akv.shm`): ``table``
    its words (`words`), ``base`` the first word of the request's bucket. The answer is
    ``(token, fingerprint, generation word)``, None if no slot holds ``token_hash``. Every
    token of the bucket is loaded first, then the matching slot's other words, then its token
    again (x86-64 keeps loads in program order): a prefill rank writes a slot's token last
    when it publishes and clears it first, so a token read as EXPOSED comes with the
    fingerprint and generation of that exposure or of a later one, never of an earlier one,
    and a slot cleared and written again between the loads (its token changed) is read again."""
    end = base + BUCKET_WORDS
    for _ in range(4):
        tokens = table[base:end:SLOT_WORDS].tolist()
        for i, token in enumerate(tokens):
            if token >> 16 == token_hash:
                at = base + i * SLOT_WORDS
                fp, word = table[at + 1], table[at + 2]
                if table[at] == token:
                    return token, fp, word
                break  # rewritten under the loads: read the bucket again
        else:
            return None
    return None  # rewritten on every read: taken as not exposed (the pull fails, unread)


def live(slot: tuple[int, int, int] | None) -> bool:
    """True if a slot (`shared_slot`'s answer) holds an exposure that was not released: one
    whose readers' "done" notices are awaited."""
    return slot is not None and (slot[0] & 0xFFFF) in LIVE


def verify(
    bucket: npt.NDArray[Any] | tuple[int, int, int] | None,
    request_id: str,
    block_ids: npt.NDArray[np.int32],
    *,
    prefill_rank: int,
    read_ids: Sequence[int] | npt.NDArray[Any] = (),
    generation: int = 0,
    packed: bool = False,
    token_hash: int | None = None,
    fingerprint: int | None = None,
) -> UnsafeReadError | None:
    """Check a bucket read after the data reads: None if ``request_id`` is exposed with exactly
    ``block_ids`` (and, given a ``generation``, is still that exposure); else the typed error
    saying why the bytes cannot be trusted. ``bucket``: the bucket's words, or the request's
    slot read already (`shared_slot`'s answer, None: not found). ``packed``: the bytes came
    from the request's packed copy, which stays valid after its blocks were released early
    (state PACKED). ``token_hash`` and ``fingerprint``: `request_hash` of ``request_id`` and
    `digest` of ``block_ids``, where the caller has them already (a pull computes each once)."""
    h = request_hash(request_id) if token_hash is None else token_hash
    if bucket is None or isinstance(bucket, tuple):
        slot: Any = bucket
    else:
        # A bucket is 16 slots of 3 words: plain ints are cheaper to scan than numpy masks.
        slot = next(
            (
                row
                for row in np.asarray(bucket, dtype=np.int64).reshape(SLOTS, SLOT_WORDS).tolist()
                if row[0] >> 16 == h
            ),
            None,
        )
    if slot is None:
        return NotExposedError(
            f"{_where(request_id, prefill_rank)} is not exposed (never exposed there, or released "
            "long ago): the blocks read may hold another request's KV",
            prefill_rank=prefill_rank,
            block_ids=_ids(read_ids),
        )
    token, fp, word = slot
    n, gen = word & 0xFFFFFFFF, word >> 32
    state = token & 0xFFFF
    if generation and gen != generation & GENERATION_MASK:
        return ReexposedError(
            f"{_where(request_id, prefill_rank)} was released and exposed again (generation {gen}, "
            f"this pull started under {generation & GENERATION_MASK}): the blocks read may hold "
            "the new exposure's KV",
            prefill_rank=prefill_rank,
            block_ids=_ids(read_ids),
        )
    if state == RELEASED_EXPIRED:
        return LeaseExpiredError(
            f"{_where(request_id, prefill_rank)} was released by lease before the reads completed: "
            "raise the lease, or pull sooner",
            prefill_rank=prefill_rank,
            block_ids=_ids(read_ids),
        )
    if state == PACKED and not packed:
        return ReleasedError(
            f"{_where(request_id, prefill_rank)} was released to its engine after packing: only its "
            "packed copy may be read (transfer='packed')",
            prefill_rank=prefill_rank,
            block_ids=_ids(read_ids),
        )
    if state != EXPOSED and state != PACKED:
        how = "by the producer closing" if state == RELEASED_CLOSED else "after every reader notified"
        return ReleasedError(
            f"{_where(request_id, prefill_rank)} was released ({how}) before the reads finished",
            prefill_rank=prefill_rank,
            block_ids=_ids(read_ids),
        )
    if n != block_ids.size or fp != (digest(block_ids) if fingerprint is None else fingerprint):
        return OutsideExposureError(
            f"{_where(request_id, prefill_rank)} is exposed with {n} other block ids than the "
            f"{block_ids.size} given: blocks outside its exposure were read",
            prefill_rank=prefill_rank,
            block_ids=_ids(read_ids),
        )
    return None


def _where(request_id: str, prefill_rank: int) -> str:
    return f"request {request_id!r} on prefill rank {prefill_rank}"
