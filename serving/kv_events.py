"""What each replica's KV cache holds, from the replica's own word: vLLM's KV events.

A replica started with a KV events publisher (``EngineConfig.kv_events``: vLLM's ``--kv-events-config`` with its
ZMQ publisher) reports every block its prefix cache stores (``BlockStored``: the blocks' hashes, their parent,
and per block the ``(mm identifier, offset)`` pairs of the images in it — the identifier is the image's
``multi_modal_uuid``, i.e. mmrag's ImageKey — and, on a prompt's first block, its ``cache_salt``), every block it
evicts (``BlockRemoved``) and a reset of its whole cache (``AllBlocksCleared``). Each batch of events carries a
sequence number; the publisher keeps its last batches for replay on a second socket.

:class:`ReplicaBlocks` folds one replica's events into what routing needs: the leading image prefixes it holds,
as ``(salt, image 1, ..., image k)``, each held while a block that starts image k (offset >= 0) in a chain that
starts with the salt and images 1..k-1 is stored. Pure: no I/O. :class:`KvEventIndex` keeps one per replica with
its state — ``synced`` (every batch since the replica's start, or since its last reset, was applied), ``unknown``
(a gap the publisher could not replay: the replica's blocks are known only after its next reset) or ``lost``
(its publisher is unreachable) — and answers, for a plan's salt and image identifiers, how long a leading prefix
each synced replica holds; the routing rule (serving/routing.py) takes that as data, and the learned table for
the replicas it does not cover. :class:`KvEventSubscriber` is the one subscriber both transports use: a thread
with a ZMQ SUB socket per replica (and a replay request on reconnecting, or on a gap in the sequence).

The system prompt is not in the key: its blocks carry no extra keys, so two plans with the same salt and images
under different system prompts look alike here (they share no KV; a wrong guess costs a miss, never an answer).
The events carry token ids, i.e. document text: keep the publishers' ports on a private network.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

log = logging.getLogger(__name__)

Prefix = tuple[str, ...]  # (cache salt, image identifier, ...): a leading image prefix as the events show it
BlockHash = int | bytes

# Blocks one replica's index keeps at most: more than any replica's KV holds; past it, the events and the index
# disagree (removals lost), and the replica is marked unknown until its next reset.
MAX_BLOCKS = 1 << 20
REPLAY_TIMEOUT_MS = 5000
END_SEQ = -1


# --- the wire format (vllm/distributed/kv_events.py), the fields routing reads -----------------------------------

class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    extra_keys: list[list[Any] | None] | None = None
    medium: str | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_decode = msgspec.msgpack.Decoder(EventBatch).decode


def publisher_config(endpoint: str) -> dict[str, Any]:
    """vLLM's ``--kv-events-config`` for a replica publishing on ``endpoint`` (``tcp://*:PORT`` binds every
    interface; vLLM binds only wildcard and ipc endpoints, and connects to any other), its replay on the next
    port (:func:`replay_endpoint`)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
            "replay_endpoint": replay_endpoint(endpoint)}


def replay_endpoint(endpoint: str) -> str:
    """The replay socket beside a publisher: the next TCP port, or ``<path>-replay`` for ipc."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + 1}"
    if endpoint.startswith("ipc://"):
        return endpoint + "-replay"
    raise ValueError(f"KV events endpoint {endpoint!r}: give tcp://HOST:PORT or ipc://PATH")


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A free TCP port whose next one is free too: a publisher and its replay socket (a Ray engine replica takes
    one on its node; tests and benchmarks too). Outside the ephemeral range (mmrag/adapters/ports.py): no client
    connection takes them before the engine binds them."""
    from mmrag.adapters.ports import unused_ports

    return unused_ports(2, host)


def subscriber_endpoint(endpoint: str, host: str = "127.0.0.1") -> str:
    """Where a subscriber connects for a publisher bound at ``endpoint`` (a wildcard host becomes ``host``)."""
    return endpoint.replace("tcp://*:", f"tcp://{host}:")


# --- one replica's blocks ----------------------------------------------------------------------------------------

@dataclass(slots=True)
class _Block:
    path: Prefix | None  # the salt and the images started in this block's chain, up to and including it
    leads: tuple[Prefix, ...]  # the prefixes whose last image starts in this block


class ReplicaBlocks:
    """The leading image prefixes one replica holds, folded from its events."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[BlockHash, _Block] = {}
        self._held: Counter[Prefix] = Counter()

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, event: _Stored | _Removed | _Cleared) -> bool:
        """Fold one event in; False when the index can no longer be trusted (more blocks than any KV holds)."""
        if isinstance(event, _Cleared):
            self.clear()
        elif event.medium not in (None, "GPU") or event.group_idx not in (None, 0):
            pass  # an offloading tier's copy, or another KV group's view of the same tokens
        elif isinstance(event, _Removed):
            for h in event.block_hashes:
                block = self._blocks.pop(h, None)
                for lead in block.leads if block else ():
                    self._held[lead] -= 1
                    if self._held[lead] <= 0:
                        del self._held[lead]
        else:
            self._store(event)
        return len(self._blocks) <= self.max_blocks

    def _store(self, event: _Stored) -> None:
        parent = event.parent_block_hash
        path: Prefix | None
        if parent is None:
            first = (event.extra_keys or [None])[0] or []
            path = (next((k for k in first if isinstance(k, str)), ""),)  # vLLM puts the salt in block 0 only
        else:
            known = self._blocks.get(parent)
            path = known.path if known else None  # a parent never seen (or evicted): this chain is unknown
        for i, h in enumerate(event.block_hashes):
            leads: list[Prefix] = []
            keys = (event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys) else None) or []
            for key in keys:
                if path is not None and isinstance(key, (list, tuple)) and len(key) == 2 and key[1] >= 0:
                    path = (*path, str(key[0]))  # the image starts in this block
                    leads.append(path)
            if h in self._blocks:
                continue  # re-reported (a prefix-cache hit reports the blocks it reused): stored once
            self._blocks[h] = _Block(path, tuple(leads))
            for lead in leads:
                self._held[lead] += 1

    def clear(self) -> None:
        self._blocks.clear()
        self._held.clear()

    def match(self, salt: str, images: Sequence[str]) -> int:
        """How many leading images of a prompt with ``salt`` and ``images`` (their identifiers, in order) this
        replica holds the starting blocks of."""
        n = 0
        for k in range(1, len(images) + 1):
            if not self._held.get((salt, *images[:k])):
                break
            n = k
        return n

    def prefixes(self) -> int:
        return len(self._held)


class State(str, enum.Enum):
    SYNCED = "synced"  # every batch applied: the index is the replica's word
    UNKNOWN = "unknown"  # a gap that could not be replayed: unknown until the replica's next reset
    LOST = "lost"  # the publisher is unreachable (the replica is down or restarting)


@dataclass
class _Replica:
    blocks: ReplicaBlocks
    state: State = State.LOST
    next_seq: int = 0  # the sequence number of the next batch to apply
    # This process reset the replica's cache and its reset event has not come yet: what comes before it is
    # older than the reset, and skipped.
    awaiting_reset: bool = False
    events: int = 0  # events received
    resyncs: int = 0  # replays asked for (a reconnect or a gap)


@dataclass
class KvEventIndex:
    """Every replica's :class:`ReplicaBlocks` and state; thread-safe (the subscriber thread writes, the router
    reads). Replicas are named as the transport names them (a replica URL, a Ray replica id)."""

    max_blocks: int = MAX_BLOCKS
    _replicas: dict[str, _Replica] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)

    def add(self, replica: str) -> None:
        with self._lock:
            self._replicas.setdefault(replica, _Replica(ReplicaBlocks(self.max_blocks)))

    def discard(self, replica: str) -> None:
        with self._lock:
            self._replicas.pop(replica, None)

    def holding(self, replicas: Iterable[str], salt: str, images: Sequence[str]) -> dict[str, int]:
        """For each of ``replicas`` whose events are synced: how many leading ``images`` it holds. Replicas left
        out are not known by events (routing asks its learned table for them). A plan without images: {}."""
        if not images:
            return {}
        with self._lock:
            return {r: rep.blocks.match(salt, images) for r in replicas
                    if (rep := self._replicas.get(r)) is not None and rep.state is State.SYNCED}

    def cleared(self, replica: str) -> None:
        """This process reset the replica's prefix cache (and the replica said it did): it holds nothing now.
        vLLM publishes the reset with the replica's next engine step (an idle replica takes none), so the process
        that reset it says so at once, and skips the events still on their way from before the reset until the
        reset's own event comes; other routers learn of it from that event."""
        with self._changing(replica) as rep:
            if rep is not None:
                rep.blocks.clear()
                rep.awaiting_reset = True

    def state(self, replica: str) -> State | None:
        with self._lock:
            rep = self._replicas.get(replica)
            return rep.state if rep else None

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per replica: state, events received, blocks and prefixes indexed, replays asked for."""
        with self._lock:
            return {r: {"state": rep.state.value, "events": rep.events, "blocks": len(rep.blocks),
                        "prefixes": rep.blocks.prefixes(), "resyncs": rep.resyncs}
                    for r, rep in self._replicas.items()}

    def wait(self, predicate, timeout: float) -> bool:
        """Block until ``predicate(self)`` holds after some change (or now); False after ``timeout`` s."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self._view()), timeout)

    def _view(self) -> _Snapshot:
        return _Snapshot(self._replicas)

    # -- written by the subscriber ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _changing(self, replica: str) -> Iterator[_Replica | None]:
        """``replica``'s entry (None once it is no longer followed), under the lock; waiters are woken after."""
        with self._changed:
            yield self._replicas.get(replica)
            self._changed.notify_all()

    def _apply(self, replica: str, seq: int, batch: EventBatch) -> None:
        with self._changing(replica) as rep:
            if rep is None:
                return
            rep.events += len(batch.events)
            rep.next_seq = seq + 1
            cleared = False
            for event in batch.events:
                if rep.awaiting_reset:
                    rep.awaiting_reset = not isinstance(event, _Cleared)
                    continue  # older than the reset this process made: the index is already empty
                if not rep.blocks.apply(event):
                    log.warning("KV events of %s: more blocks than any KV cache holds (removals lost); its "
                                "blocks are unknown until its next reset", replica)
                    rep.blocks.clear()
                    rep.state = State.UNKNOWN
                cleared = cleared or isinstance(event, _Cleared)
            if cleared and rep.state is State.UNKNOWN:
                rep.state = State.SYNCED  # a reset: from here on every block it holds is in its events

    def _set(self, replica: str, state: State, *, reset: bool = False, next_seq: int | None = None,
             resync: bool = False) -> None:
        with self._changing(replica) as rep:
            if rep is None:
                return
            if reset:
                rep.blocks.clear()
                rep.awaiting_reset = False
            if next_seq is not None:
                rep.next_seq = next_seq
            rep.resyncs += resync
            if rep.state is not state:
                log.info("KV events of %s: %s", replica, state.value)
            rep.state = state

    def _next_seq(self, replica: str) -> int | None:
        with self._lock:
            rep = self._replicas.get(replica)
            return rep.next_seq if rep else None


@dataclass(frozen=True)
class _Snapshot:
    """What :meth:`KvEventIndex.wait`'s predicate reads (under the index's lock)."""

    _replicas: Mapping[str, _Replica]

    def state(self, replica: str) -> State | None:
        rep = self._replicas.get(replica)
        return rep.state if rep else None

    def match(self, replica: str, salt: str, images: Sequence[str]) -> int:
        rep = self._replicas.get(replica)
        return rep.blocks.match(salt, images) if rep else 0

    def events(self, replica: str) -> int:
        rep = self._replicas.get(replica)
        return rep.events if rep else 0


# --- the subscriber ----------------------------------------------------------------------------------------------

class KvEventSubscriber:
    """One thread that subscribes to every replica's publisher and keeps ``index`` up to date.

    On connecting (and reconnecting) to a publisher it asks for a replay from the start: a buffer that begins at
    sequence 0 rebuilds the replica's blocks from scratch (a restarted replica is seen so), one that resumes at
    the next batch this index expects continues it, anything else leaves the replica unknown until its next
    reset. A batch past the next expected one (a gap) asks for a replay from the first one missing."""

    POLL_MS = 100

    def __init__(self, endpoints: Mapping[str, str] | None = None, index: KvEventIndex | None = None) -> None:
        import zmq

        self.index = index or KvEventIndex()
        # Routes decided by the replicas' events ("events": every live replica's known) or the learned table.
        self.routed: Counter[str] = Counter()
        self._expected: set[str] = set()  # replicas the transport has now, followed or not (Ray: its router's)
        self._endpoints: dict[str, str] = {}
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._commands: queue.SimpleQueue[tuple[str, str, str | None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.turns = 0  # turns of the thread's loop: a subscriber that follows nothing waits, it does not spin
        for replica, endpoint in (endpoints or {}).items():
            self.add(replica, endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def add(self, replica: str, endpoint: str) -> None:
        """Follow ``replica``'s publisher at ``endpoint`` (as the replica binds it; a wildcard host is this
        host)."""
        if self._endpoints.get(replica) == endpoint:
            return
        self._endpoints[replica] = endpoint
        self.index.add(replica)
        self._commands.put(("add", replica, endpoint))

    def discard(self, replica: str) -> None:
        self._endpoints.pop(replica, None)
        self.index.discard(replica)
        self._commands.put(("discard", replica, None))

    def expect(self, replicas: Iterable[str]) -> None:
        """The transport's live replicas now: the others are no longer followed; :meth:`missing` lists those
        whose endpoints are not known yet."""
        self._expected = set(replicas)
        for gone in set(self._endpoints) - self._expected:
            self.discard(gone)

    def missing(self) -> set[str]:
        return self._expected - set(self._endpoints)

    def decided(self, known: Mapping[str, int], replicas: int) -> None:
        """Count one route: by events when every live replica's events were known, else by the table."""
        self.routed["events" if known and len(known) == replicas else "table"] += 1

    def close(self) -> None:
        """Stop following (idempotent): the thread closes its sockets, then the context ends."""
        self._stop.set()
        self._thread.join(timeout=5)
        if not self._ctx.closed:
            self._ctx.term()

    # -- the thread -------------------------------------------------------------------------------------------

    def _run(self) -> None:
        zmq = self._zmq
        subs: dict[str, tuple[Any, Any, str]] = {}  # replica -> (SUB socket, its monitor, endpoint)
        by_socket: dict[Any, tuple[str, str]] = {}  # socket -> (replica, "sub" | "monitor")
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self.turns += 1
                self._take_commands(subs, by_socket, poller)
                if not by_socket:
                    # zmq's poll over no socket returns at once: following no replica (Ray's subscriber before its
                    # first replica or after its last), the thread waits here instead of spinning on a core.
                    self._stop.wait(self.POLL_MS / 1000)
                    continue
                for sock, _ in poller.poll(self.POLL_MS):
                    replica, kind = by_socket.get(sock, (None, None))
                    if replica is None:
                        continue
                    if kind == "monitor":
                        self._on_monitor(replica, sock, subs[replica][2])
                    else:
                        self._on_batch(replica, sock.recv_multipart(), subs[replica][2])
        finally:
            for sub, monitor, _ in subs.values():
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)

    def _take_commands(self, subs, by_socket, poller) -> None:
        zmq = self._zmq
        while True:
            try:
                what, replica, endpoint = self._commands.get_nowait()
            except queue.Empty:
                return
            old = subs.pop(replica, None)
            if old is not None:
                for sock in old[:2]:
                    poller.unregister(sock)
                    by_socket.pop(sock, None)
                old[0].disable_monitor()
                old[1].close(linger=0)
                old[0].close(linger=0)
            if what == "add" and endpoint is not None:
                sub = self._ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.setsockopt(zmq.RECONNECT_IVL, 100)
                sub.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
                monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
                sub.connect(subscriber_endpoint(endpoint))
                subs[replica] = (sub, monitor, endpoint)
                by_socket[sub] = (replica, "sub")
                by_socket[monitor] = (replica, "monitor")
                poller.register(sub, zmq.POLLIN)
                poller.register(monitor, zmq.POLLIN)

    def _on_monitor(self, replica: str, monitor: Any, endpoint: str) -> None:
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(monitor)["event"]
        if event == self._zmq.EVENT_DISCONNECTED:
            self.index._set(replica, State.LOST)
        elif event == self._zmq.EVENT_CONNECTED:
            self._replay(replica, endpoint, 0)

    def _on_batch(self, replica: str, frames: list[bytes], endpoint: str) -> None:
        seq, batch = _parse(frames)
        if batch is None:
            return
        expected = self.index._next_seq(replica)
        if expected is None or seq < expected:
            return  # already applied (from a replay), or a replica no longer followed
        if seq > expected and self.index.state(replica) is State.SYNCED:
            self._replay(replica, endpoint, expected)  # a gap: the batches in between first
            if self.index._next_seq(replica) != seq:
                return  # the replay did not reach this batch: the replica is unknown now
        self.index._apply(replica, seq, batch)

    def _replay(self, replica: str, endpoint: str, start: int) -> None:
        """Ask the publisher for its batches from ``start`` on and apply them (0: rebuild from scratch)."""
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
        try:
            sock.connect(subscriber_endpoint(replay_endpoint(endpoint)))
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            got: list[tuple[int, EventBatch]] = []
            while True:
                frames = sock.recv_multipart()  # [b"", topic, seq, payload]
                seq, batch = _parse(frames[1:])
                if seq == END_SEQ:
                    break
                if batch is not None:
                    got.append((seq, batch))
        except zmq.Again:
            log.warning("KV events of %s: no replay within %.0f s; its blocks are unknown until its next reset",
                        replica, REPLAY_TIMEOUT_MS / 1000)
            self.index._set(replica, State.UNKNOWN, reset=True, resync=True)
            return
        finally:
            sock.close(linger=0)
        first = got[0][0] if got else None
        expected = self.index._next_seq(replica) or 0
        if start == 0 and first in (None, 0):
            # The whole history is in the buffer: rebuild (a restarted publisher also starts at 0 again).
            self.index._set(replica, State.SYNCED, reset=True, next_seq=0, resync=True)
        elif (first is not None and first <= expected) or (first is None and start == expected):
            self.index._set(replica, State.SYNCED, resync=True)  # the same publisher: resume where we were
        else:
            log.warning("KV events of %s: batches from %d on are no longer in its publisher's buffer; its blocks "
                        "are unknown until its next reset", replica, expected)
            # Applied all the same: a reset among them makes the index exact again from there on.
            self.index._set(replica, State.UNKNOWN, reset=True, next_seq=first or expected, resync=True)
        for seq, batch in got:
            if seq >= (self.index._next_seq(replica) or 0):
                self.index._apply(replica, seq, batch)


_SHARED: dict[str, KvEventSubscriber] = {}
_SHARED_LOCK = threading.Lock()


def shared_subscriber(name: str) -> KvEventSubscriber:
    """The one subscriber of this process for deployment ``name``: Ray Serve builds the request router itself
    (serving/ray/router.py), so the router and the engine client (serving/ray/engine.py, which learns the
    replicas' endpoints) meet here rather than by injection."""
    with _SHARED_LOCK:
        if name not in _SHARED:
            _SHARED[name] = KvEventSubscriber()
        return _SHARED[name]


def _parse(frames: list[bytes]) -> tuple[int, EventBatch | None]:
    """(sequence number, batch) of a published message ``[topic, seq, payload]``; an undecodable payload is
    logged and skipped (None)."""
    if len(frames) < 3:
        return END_SEQ, None
    seq = int.from_bytes(frames[-2], "big", signed=True)
    if seq == END_SEQ or not frames[-1]:
        return seq, None
    try:
        return seq, _decode(frames[-1])
    except msgspec.DecodeError as exc:
        log.warning("KV events: an undecodable batch %d (%s); skipped", seq, exc)
        return seq, None
