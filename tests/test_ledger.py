"""The release ledger and the exposure check, pure (no NIXL): a hypothesis state machine
interleaving expose / extend / expire / release / pull / notice over a few requests and two
decode ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import akv
from akv.exposure import ExposureTable, digest, verify
from akv.ledger import ReleaseLedger
from akv.protocol.messages import Notice

ENGINE, DECODE_TP, NUM_BLOCKS = "decode", 2, 12
REQUESTS = [f"r{i}" for i in range(4)]


@dataclass
class Pull:
    """A decode rank's pull in flight: what it read and whether its exposure was intact."""

    rank: int
    request_id: str
    given: list[int]  # the remote block ids the pull was given (the whole exposure, it thinks)
    read: list[int]  # the blocks it reads (the tail on a prefix hit)
    intact: bool = True  # every block read stayed exposed for the request since the start


@dataclass
class Model:
    exposed: dict[str, list[int]] = field(default_factory=dict)
    released: dict[str, int] = field(default_factory=dict)
    ever: set[str] = field(default_factory=set)  # ids used (exposed, or pulled before any expose)
    exposed_ever: set[str] = field(default_factory=set)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.table = ExposureTable(buckets=2)  # tiny: requests share buckets
        self.ledger = ReleaseLedger(
            NUM_BLOCKS,
            lease_s=1.0,
            expected=lambda decode_tp: decode_tp,  # every decode rank notifies (heads split over D)
            accepts=lambda n: n.engine_id == ENGINE and 0 <= n.decode_rank < n.decode_tp == DECODE_TP,
            table=self.table,
        )
        self.model = Model()
        self.pulls: list[Pull] = []
        self.readers: dict[str, set[int]] = {}

    def _released(self, releases: list[akv.Release]) -> None:
        for rel in releases:
            self.model.released[rel.request_id] = self.model.released.get(rel.request_id, 0) + 1
            blocks = self.model.exposed.pop(rel.request_id)
            assert rel.block_ids.tolist() == blocks
            if rel.reason == "read":
                assert self.readers.get(rel.request_id, set()) == set(range(DECODE_TP))
            for pull in self.pulls:  # the engine may now reuse these blocks: no longer intact
                if pull.request_id == rel.request_id:
                    pull.intact = False

    @rule(rid=st.sampled_from(REQUESTS), n=st.integers(1, 3), data=st.data())
    def expose(self, rid: str, n: int, data: st.DataObject) -> None:
        if rid in self.model.ever:
            return  # request ids are unique in an engine
        used = {b for blocks in self.model.exposed.values() for b in blocks}
        free = [b for b in range(NUM_BLOCKS) if b not in used]
        if len(free) < n:
            return
        blocks = data.draw(st.permutations(free))[:n]
        self.ledger.expose(rid, blocks, self.now)
        self.model.exposed[rid] = list(blocks)
        self.model.ever.add(rid)
        self.model.exposed_ever.add(rid)

    @rule(rid=st.sampled_from(REQUESTS))
    def extend(self, rid: str) -> None:
        if rid in self.model.exposed:
            self.ledger.extend(rid, self.now)

    @rule(dt=st.floats(0.1, 1.5))
    def advance(self, dt: float) -> None:
        self.now += dt
        releases, _ = self.ledger.expire(self.now)
        assert all(r.reason == "expired" for r in releases)
        self._released(releases)

    @rule(
        rank=st.integers(0, DECODE_TP - 1),
        rid=st.sampled_from(REQUESTS),
        variant=st.sampled_from(["right", "tail", "wrong", "other"]),
    )
    def start_pull(self, rank: int, rid: str, variant: str) -> None:
        exposed = self.model.exposed.get(rid)
        if variant == "other":  # another exposed request's blocks under this id
            others = [b for k, v in self.model.exposed.items() if k != rid for b in v]
            given = others[:2] or [0]
        elif exposed is None or variant == "wrong":
            given = [(b + 5) % NUM_BLOCKS for b in (exposed or [0, 1])]
        else:
            given = list(exposed)
        read = given[1:] if variant == "tail" and len(given) > 1 else given
        intact = exposed is not None and given == exposed
        if exposed is None:
            # The contract: block ids come from the producer's announcement, after expose().
            # A pull of a request not exposed yet is a bogus one, and that id stays unexposed.
            self.model.ever.add(rid)
        self.pulls.append(Pull(rank, rid, given, read, intact))

    @precondition(lambda self: self.pulls)
    @rule(data=st.data())
    def complete_pull(self, data: st.DataObject) -> None:
        pull = self.pulls.pop(data.draw(st.integers(0, len(self.pulls) - 1)))
        bucket = self.table.array[self.table.bucket_of(pull.request_id)].copy()  # the check read
        ids = np.asarray(pull.given, dtype=np.int32)
        error = verify(bucket, pull.request_id, ids, prefill_rank=0, read_ids=pull.read)
        if error is None:
            assert pull.intact, f"success for {pull} whose blocks were not exposed throughout"
        # The "done" notice rides on the check read, whatever the outcome.
        notice = Notice("done", ENGINE, pull.rank, DECODE_TP, [pull.request_id], [digest(ids)])
        if error is None:
            self.readers.setdefault(pull.request_id, set()).add(pull.rank)
        self._released(self.ledger.on_notice(notice, self.now))

    @rule(rid=st.sampled_from(REQUESTS), rank=st.integers(0, DECODE_TP - 1))
    def foreign_notice(self, rid: str, rank: int) -> None:
        """A notice naming a request with blocks of another one never counts."""
        notice = Notice("done", ENGINE, rank, DECODE_TP, [rid], [digest(np.array([99], np.int32))])
        assert self.ledger.on_notice(notice, self.now) == []

    @invariant()
    def released_at_most_once(self) -> None:
        assert all(n == 1 for n in self.model.released.values())
        assert len(self.ledger) == len(self.model.exposed)

    def teardown(self) -> None:
        self._released(self.ledger.close())
        assert set(self.model.released) == self.model.exposed_ever
        assert all(n == 1 for n in self.model.released.values())


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_expose_rejects_no_blocks_and_duplicates() -> None:
    """expose() with no block ids is a BlockIdError; a request exposed twice is a ConfigError."""
    ledger = ReleaseLedger(8, lease_s=1, expected=lambda d: 1, accepts=lambda n: True)
    with pytest.raises(akv.BlockIdError, match="no block ids"):
        ledger.expose("x", [], 0.0)
    ledger.expose("x", [1], 0.0)
    with pytest.raises(akv.ConfigError, match="already exposed"):
        ledger.expose("x", [2], 0.0)


def test_full_bucket_is_a_typed_error() -> None:
    """More live exposures in one bucket than it has slots raise ConfigError naming the knob."""
    ledger = ReleaseLedger(64, lease_s=1, expected=lambda d: 1, accepts=lambda n: True,
                           table=ExposureTable(buckets=1))  # fmt: skip
    for i in range(16):
        ledger.expose(f"r{i}", [i], 0.0)
    with pytest.raises(akv.ConfigError, match="max_exposed"):
        ledger.expose("r16", [16], 0.0)
    ledger.release("r0", "read")
    ledger.expose("r16", [16], 0.0)  # a released slot is reused
