"""Exposure tables in shared memory (`akv.shm`): a decode rank on the prefill rank's host
copies its check's bucket from the table with a memory load instead of a READ, and the check
still fails every pull whose blocks were released before it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest

import akv
from akv import exposure, shm
from akv.exposure import ExposureTable
from tests.conftest import decode_rank, make_spec, prefill_engine, verify, wait_for
from tests.transfers import HeldBackend

SHAPE = (8, exposure.SLOTS, exposure.SLOT_WORDS)
IDS = np.arange(4, dtype=np.int32)

#: Run in another process: map the table a share names and verify request "r1" in it.
CHILD = """
import sys
import anyio
import msgspec
import numpy as np
from akv import exposure, shm
share = msgspec.json.decode(sys.argv[1], type=shm.TableShare)
view = shm.open_table(share, (8, exposure.SLOTS, exposure.SLOT_WORDS))
if view is None:
    print("unmapped")
else:
    bucket = view[exposure.request_hash("r1") % 8]
    err = exposure.verify(bucket, "r1", np.arange(4, dtype=np.int32), prefill_rank=0, generation=7)
    print(type(err).__name__ if err is not None else "exposed", view.flags.writeable)
"""


def child_sees(share: shm.TableShare) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, msgspec.json.encode(share).decode()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_another_process_of_this_host_maps_the_table_read_only_and_sees_each_release() -> None:
    """A table in shared memory is mapped by another process of this host through the share
    its handshake offers, read-only, and shows each write of the prefill rank: the exposure,
    then its release by lease. A share with another token or host, or a table of another
    size, or a file descriptor that is no table (a pipe), maps nothing; once the table is
    closed no new process maps it."""
    table = ExposureTable(SHAPE[0], shared=True)
    share = table.share()
    assert share is not None
    table.publish("r1", IDS, generation=7)
    assert child_sees(share) == "exposed False"
    table.retire("r1", "expired")
    assert child_sees(share) == "LeaseExpiredError False"
    assert shm.open_table(msgspec.structs.replace(share, token=b"\0" * 16), SHAPE) is None
    assert shm.open_table(msgspec.structs.replace(share, host="another-host"), SHAPE) is None
    assert shm.open_table(share, (9, *SHAPE[1:])) is None
    # a peer naming a pipe with no writer (an open that would wait for one): refused at once
    read_end, write_end = os.pipe()
    os.close(write_end)
    try:
        pipe = msgspec.structs.replace(share, pid=os.getpid(), fd=read_end)
        opened: list[object] = []
        thread = threading.Thread(target=lambda: opened.append(shm.open_table(pipe, SHAPE)), daemon=True)
        thread.start()
        thread.join(10)
        assert opened == [None]
    finally:
        os.close(read_end)
    view = shm.open_table(share, SHAPE)
    assert view is not None and not view.flags.writeable
    table.close()
    assert table.share() is None and child_sees(share) == "unmapped"
    table.publish("r1", IDS, generation=8)  # a map made before the close still follows the table
    bucket = view[exposure.request_hash("r1") % SHAPE[0]]
    assert isinstance(exposure.verify(bucket, "r1", IDS, prefill_rank=0, generation=7), akv.ReexposedError)


class HeldNoHeartbeats(HeldBackend):
    """The real agent, reporting every transfer running until ``hold_until`` and sending no
    notice while it holds (the pull's lease heartbeats), so that the lease runs out."""

    def notify(self, agent: str, message: bytes) -> None:
        if time.monotonic() >= self.hold_until:
            super().notify(agent, message)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the check is the same under trio (tests/test_session.py runs both)


@pytest.mark.anyio
async def test_a_lease_that_runs_out_during_the_data_reads_fails_the_pull_checked_in_shared_memory() -> None:
    """A pull whose data reads are still running when the request's lease runs out fails
    with LeaseExpiredError: its check, a memory load from the prefill rank's table in shared
    memory (mapped through the share the handshake offered; no check READ posted), sees the
    release the prefill rank wrote before handing the blocks back; the request is released
    once, by lease."""
    spec = make_spec(kv_heads=4)
    backend = HeldNoHeartbeats(f"held-shm-{id(spec)}")
    async with (
        prefill_engine(spec, 1) as engine,
        decode_rank(spec, backend=backend, same_process="nixl") as consumer,
    ):
        session = await consumer.connect(engine.endpoint)
        engine.fill("r1", [1], seed=1, lease=0.3)
        backend.hold_until = time.monotonic() + 30
        transfer = await session.pull("r1", [2], [1])
        await wait_for(lambda: [r.reason for r in engine.releases] == ["expired"])
        backend.hold_until = 0.0
        with pytest.raises(akv.LeaseExpiredError):
            await transfer
        counters: dict[str, Any] = consumer.metrics.snapshot().counters
        assert counters["checks_shared"] == 1 and counters.get("xfers_check", 0) == 0
        engine.fill("r2", [3], seed=2)  # and a pull of a live exposure verifies
        await (await session.pull("r2", [4], [3]))
        assert verify(consumer, [4], 2, range(1))
        assert consumer.metrics.snapshot().counters["checks_shared"] == 2
        await wait_for(lambda: sorted(r.reason for r in engine.releases) == ["expired", "read"])


@pytest.mark.anyio
async def test_a_session_closed_right_after_its_pull_still_sends_the_queued_notice() -> None:
    """A pull checked in shared memory completes before its "done" notice leaves (the
    notice waits for a background READ); a session closed right after it, before its
    consumer's poller ran, sends that notice before it unlinks the rank: the prefill rank
    releases the request once, by read, and no notice is dropped."""
    spec = make_spec(kv_heads=4)
    async with (
        prefill_engine(spec, 2) as engine,
        decode_rank(spec, same_process="nixl") as consumer,
    ):
        session = await consumer.connect(engine.endpoint)
        engine.fill("r1", [1], seed=1)
        await (await session.pull("r1", [2], [1]))
        await session.aclose()
        assert verify(consumer, [2], 1, range(1))
        await wait_for(lambda: [(r.request_id, r.reason) for r in engine.releases] == [("r1", "read")] * 2)
        counters = consumer.metrics.snapshot().counters
        assert counters["checks_shared"] == 2 and counters.get("notices_dropped", 0) == 0


class _Rewritten:
    """A directory bucket whose fields a prefill rank rewrites between reads: each read of
    the fields returns the next of ``versions`` (the last one from then on)."""

    def __init__(self, versions: list[np.ndarray]) -> None:
        self.versions = versions
        self.reads = 0

    def __getitem__(self, key: Any) -> np.ndarray:
        if key == (slice(None), 0):
            return self.versions[0][:, 0]
        version = self.versions[min(self.reads, len(self.versions) - 1)]
        self.reads += 1
        return version[key]


def test_a_directory_bucket_copied_while_rewritten_is_a_settled_entry_or_empty() -> None:
    """A packed pull's lookup in a directory in shared memory (`copy_entries`) copies the
    bucket's fields until two reads agree: fields rewritten under it once give the entry as it
    stands after, never one write's generation with another's offset; a bucket that keeps
    changing reads as empty (the pull then reads the paged blocks), and a still one exactly."""
    from akv.packing import DIR_WORDS, PackDirectory, find
    from akv.runtime.paths.tables import copy_entries

    directory = PackDirectory(1)
    assert directory.publish("r1", 7, 4096, 512)
    bucket = directory.array[0]
    slot = np.zeros_like(bucket)
    copy_entries(bucket, slot)
    assert find(slot, "r1") == (7, 4096, 512)

    moved = bucket.copy()
    row = int(np.flatnonzero(bucket[:, 0])[0])
    moved[row, 1:] = (8, 8192, 512)  # published again elsewhere, same tag
    torn = bucket.copy()
    torn[row, 1:] = (8, 4096, 512)  # mid-write: the new generation, the old offset
    copy_entries(_Rewritten([torn, moved, moved]), slot)  # type: ignore[arg-type]
    assert find(slot, "r1") == (8, 8192, 512)

    churn = [bucket.copy() for _ in range(20)]
    for n, version in enumerate(churn):
        version[row, 1] = n + 1
    copy_entries(_Rewritten(churn), slot)  # type: ignore[arg-type]
    assert find(slot, "r1") is None and slot.shape == (exposure.SLOTS, DIR_WORDS)


def test_a_slot_loaded_from_shared_memory_gives_the_verdict_of_the_bucket_read_over_nixl() -> None:
    """A check in shared memory loads only the request's slot (`shared_slot`): for every state
    of the exposure (exposed, packed, released by each reason, exposed again, with other
    block ids, never exposed) `verify` gives the same answer as on the whole bucket, which a
    check READ over NIXL brings back."""
    table = ExposureTable(SHAPE[0])
    h = exposure.request_hash("r1")
    bucket = table.array[h % SHAPE[0]]
    words, base = exposure.words(table.array), (h % SHAPE[0]) * exposure.BUCKET_WORDS
    other = np.arange(4, 8, dtype=np.int32)

    def verdicts(**kw: Any) -> tuple[str, str]:
        got = [
            exposure.verify(b, "r1", IDS, prefill_rank=0, **kw)
            for b in (bucket.copy(), exposure.shared_slot(words, h, base))
        ]
        a, b = (type(e).__name__ if e is not None else "ok" for e in got)
        return a, b

    seen = {verdicts(generation=7)[0]}  # never exposed
    table.publish("r0-neighbour", other, generation=1)  # another request in the bucket
    table.publish("r1", IDS, generation=7)
    for kw in ({"generation": 7}, {"generation": 8}, {"generation": 7, "packed": True}):
        a, b = verdicts(**kw)
        assert a == b
        seen.add(a)
    table.publish("r1", other, generation=7)
    seen.add(verdicts(generation=7)[0])
    table.publish("r1", IDS, generation=7)
    table.mark_packed("r1")
    for kw in ({"packed": False}, {"packed": True}):
        a, b = verdicts(**kw)
        assert a == b
        seen.add(a)
    for reason in ("read", "expired", "closed"):
        table.publish("r1", IDS, generation=7)
        table.retire("r1", reason)
        a, b = verdicts(generation=7)
        assert a == b
        seen.add(a)
    assert seen == {
        "ok",
        "NotExposedError",
        "ReexposedError",
        "OutsideExposureError",
        "ReleasedError",
        "LeaseExpiredError",
    }


class _Loads:
    """A bucket's words that record the order of the loads made from them, as `shared_slot`
    makes them (``after_fields``: run once the fields of a slot were loaded, as a prefill rank
    rewriting the slot meanwhile)."""

    def __init__(self, bucket: np.ndarray, after_fields: Any = None) -> None:
        self.words = exposure.words(bucket)
        self.after_fields = after_fields
        self.loads: list[str] = []
        self._fields: set[int] = set()

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            assert key.step == exposure.SLOT_WORDS and key.start % exposure.SLOT_WORDS == 0
            self.loads.append("tokens")
            return self.words[key]
        slot, word = divmod(key, exposure.SLOT_WORDS)
        if word == 0:
            self.loads.append(f"token of slot {slot}")
        else:
            self._fields.add(key)
            if {slot * exposure.SLOT_WORDS + 1, slot * exposure.SLOT_WORDS + 2} <= self._fields:
                self.loads.append(f"fields of slot {slot}")
                self._fields.clear()
                value = self.words[key]
                if self.after_fields is not None:
                    self.after_fields()
                    self.after_fields = None
                return value
        return self.words[key]


def test_a_check_in_shared_memory_loads_every_token_before_the_fields_of_its_slot() -> None:
    """The prefill rank writes a slot's token last and clears it first: `shared_slot` loads
    the tokens first, then the matching slot's fingerprint and generation, then its token
    again, so a token read as exposed never comes with an older exposure's fields, and a slot
    released and given to another request between the loads is not taken for this one's."""
    table = ExposureTable(1)
    table.publish("r0", np.arange(2, dtype=np.int32))
    table.publish("r1", IDS, generation=3)
    h = exposure.request_hash("r1")
    loads = _Loads(table.array[0])
    slot = exposure.shared_slot(loads, h)  # type: ignore[arg-type]
    assert loads.loads == ["tokens", "fields of slot 1", "token of slot 1"]
    assert slot is not None and exposure.live(slot)
    assert slot[1] == exposure.digest(IDS) and slot[2] >> 32 == 3
    absent = _Loads(table.array[0])
    assert exposure.shared_slot(absent, exposure.request_hash("r2")) is None  # type: ignore[arg-type]
    assert absent.loads == ["tokens"]

    def reuse() -> None:  # r1 released, its slot taken by r2 (a full bucket reuses released slots)
        table.array[0, 1] = [(exposure.request_hash("r2") << 16) | exposure.EXPOSED, 99, 4]

    rewritten = _Loads(table.array[0], after_fields=reuse)
    assert exposure.shared_slot(rewritten, h) is None  # type: ignore[arg-type]
    assert rewritten.loads == ["tokens", "fields of slot 1", "token of slot 1", "tokens"]
    # a bucket other than the first: loads at its own words
    wide = ExposureTable(4)
    wide.publish("r1", IDS, generation=3)
    b = h % 4
    assert exposure.shared_slot(exposure.words(wide.array), h, b * exposure.BUCKET_WORDS) == tuple(
        int(w) for w in wide.array[b][wide.array[b][:, 0] >> 16 == h][0]
    )
    assert exposure.shared_slot(exposure.words(wide.array), h, ((b + 1) % 4) * exposure.BUCKET_WORDS) is None


@pytest.mark.anyio
@pytest.mark.parametrize("case", ["never exposed", "released", "exposed on one rank of two"])
@pytest.mark.parametrize("same_process", ["auto", "nixl"])
async def test_a_pull_that_finds_its_request_not_exposed_releases_nothing_exposed_after(
    same_process: str, case: str
) -> None:
    """A pull that finds its request not exposed on some prefill rank (not yet: an engine
    pulls again until the prefill exposes it on every rank; or not any more) sends no "done"
    notice to any rank: one reaching a rank after the exposure that follows would release it
    unread. The exposure made right after the failed pull stays until the pull that reads
    it, through the copy path and through NIXL reads checked in shared memory."""
    spec = make_spec()
    ranks = 2 if case == "exposed on one rank of two" else 1
    async with (
        prefill_engine(spec, ranks) as engine,
        decode_rank(spec, same_process=same_process) as consumer,
    ):
        session = await consumer.connect(engine.endpoint)
        error: type[akv.AkvError] = akv.NotExposedError
        if case == "released":
            engine.fill("r", [1, 2], seed=4)
            await (await session.pull("r", [3, 4], [1, 2]))
            await wait_for(lambda: len(engine.releases) == 1)
            engine.releases.clear()
            error = akv.ReleasedError
        elif case == "exposed on one rank of two":
            engine.fill("r", [1, 2], seed=5, ranks=[0])
        with pytest.raises(error):
            await (await session.pull("r", [3, 4], [1, 2]))
        engine.fill("r", [1, 2], seed=5, ranks=[1] if ranks == 2 else None)
        await anyio.sleep(0.3)  # the poller's rounds: whatever the failed pull queued goes out
        assert not engine.releases
        result = await (await session.pull("r", [3, 4], [1, 2]))
        assert result.path == ("copy" if same_process == "auto" else "read")
        assert verify(consumer, [3, 4], 5, [0, 1])
        await wait_for(lambda: [r.reason for r in engine.releases] == ["read"] * ranks)
