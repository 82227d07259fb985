"""Routing by the replicas' own KV events (serving/kv_events.py): the index folded from events, the routing rule
taking it as data, and the subscriber against vLLM's own ZMQ publisher (vllm/distributed/kv_events.py, the class
every vLLM engine core publishes with), started here without an engine.

The engines' side (replicas publishing as they prefill, evict and reset) is tests/test_kv_events_replicas.py.
"""

from __future__ import annotations

import hashlib

from mmrag.core.engine import PromptPlan
from mmrag.core.keys import ContentHash, EncoderVersion, ImageKey, ResolutionPolicy
from serving.kv_events import (EventBatch, KvEventIndex, KvEventSubscriber, ReplicaBlocks, State, _Cleared,
                               _Removed, _Stored, publisher_config, replay_endpoint)
from serving.routing import AffinityTable, prefix_path, rank_replicas, rendezvous_order, route_key
from serving.kv_events import free_port_pair
from tests.waiting import eventually_sync

WAIT_S = 60.0  # a hang guard for events crossing a socket, never a speed check


def stored(hashes, parent=None, keys=None) -> _Stored:
    return _Stored(block_hashes=list(hashes), parent_block_hash=parent, extra_keys=keys, medium="GPU")


def prompt_blocks(salt: str, images: list[str], first: int) -> list[_Stored]:
    """The events of one prompt [system][image 1 in 2 blocks][image 2 in 2 blocks]: block hashes from ``first``."""
    keys: list = [[salt] if salt else None]
    for image in images:
        keys += [[[image, 5]], [[image, -27]]]  # the image starts 5 tokens into a block, goes on in the next
    return [stored(range(first, first + len(keys)), None, keys)]


# --- one replica's blocks ------------------------------------------------------------------------------------

def test_a_replica_holds_the_leading_images_whose_starting_blocks_it_stored_in_order():
    blocks = ReplicaBlocks()
    for event in prompt_blocks("", ["a", "b"], 100):
        assert blocks.apply(event)
    assert blocks.match("", ["a", "b"]) == 2
    assert blocks.match("", ["a", "c"]) == 1
    assert blocks.match("", ["b"]) == 0  # b is held only after a
    assert blocks.match("tenant", ["a"]) == 0  # another salt shares nothing


def test_a_salt_in_the_first_block_keys_the_whole_chain():
    blocks = ReplicaBlocks()
    blocks.apply(prompt_blocks("s1", ["a"], 1)[0])
    assert blocks.match("s1", ["a"]) == 1 and blocks.match("", ["a"]) == 0


def test_an_evicted_starting_block_takes_its_prefix_and_a_reset_takes_everything():
    blocks = ReplicaBlocks()
    blocks.apply(prompt_blocks("", ["a", "b"], 100)[0])  # blocks 100 (system), 101-102 (a), 103-104 (b)
    blocks.apply(_Removed(block_hashes=[103], medium="GPU"))  # b's first block
    assert blocks.match("", ["a", "b"]) == 1
    blocks.apply(_Removed(block_hashes=[102], medium="GPU"))  # a's second block: a still starts there
    assert blocks.match("", ["a"]) == 1
    blocks.apply(_Cleared())
    assert blocks.match("", ["a"]) == 0 and len(blocks) == 0


def test_a_reported_hit_stores_nothing_twice_and_one_removal_undoes_it():
    blocks = ReplicaBlocks()
    for _ in range(3):  # a prefix-cache hit re-reports the blocks it reused
        blocks.apply(prompt_blocks("", ["a"], 7)[0])
    assert len(blocks) == 3
    blocks.apply(_Removed(block_hashes=[8], medium="GPU"))
    assert blocks.match("", ["a"]) == 0


def test_a_chain_continued_from_a_parent_never_seen_is_not_guessed():
    blocks = ReplicaBlocks()
    blocks.apply(stored([50, 51], parent=49, keys=[[["a", 3]], None]))
    assert blocks.match("", ["a"]) == 0
    blocks.apply(stored([60], None, [None]))  # a system prompt, then a continuation that starts an image
    blocks.apply(stored([61], parent=60, keys=[[["a", 0]]]))
    assert blocks.match("", ["a"]) == 1


def test_an_offloaded_copy_and_another_kv_group_are_not_the_replicas_cache():
    blocks = ReplicaBlocks()
    blocks.apply(_Stored(block_hashes=[1, 2], parent_block_hash=None, extra_keys=[None, [["a", 0]]], medium="CPU"))
    blocks.apply(_Stored(block_hashes=[1, 2], parent_block_hash=None, extra_keys=[None, [["a", 0]]], group_idx=1))
    assert blocks.match("", ["a"]) == 0


def test_more_blocks_than_any_cache_holds_says_the_index_is_no_longer_trusted():
    blocks = ReplicaBlocks(max_blocks=4)
    assert blocks.apply(stored(range(4)))
    assert not blocks.apply(stored(range(10, 12)))


def test_the_index_answers_only_for_synced_replicas():
    index = KvEventIndex()
    for r in ("r1", "r2", "r3"):
        index.add(r)
    index._set("r1", State.SYNCED)
    index._set("r2", State.UNKNOWN)
    index._apply("r1", 0, EventBatch(0.0, prompt_blocks("", ["a"], 1)))
    index._apply("r2", 0, EventBatch(0.0, prompt_blocks("", ["a"], 1)))
    assert index.holding(["r1", "r2", "r3"], "", ["a"]) == {"r1": 1}  # r3 lost, r2 unknown: the table's
    assert index.holding(["r1"], "", []) == {}  # a plan without images: nothing to say
    index._apply("r2", 1, EventBatch(0.0, [_Cleared()]))  # a reset: exact again from there
    assert index.holding(["r2"], "", ["a"]) == {"r2": 0}


def test_a_reset_this_process_made_empties_the_index_at_once_and_skips_what_was_older_than_it():
    index = KvEventIndex()
    index.add("r1")
    index._set("r1", State.SYNCED)
    index._apply("r1", 0, EventBatch(0.0, prompt_blocks("", ["a"], 1)))
    index.cleared("r1")  # the replica said it reset; its event comes with its next step
    assert index.holding(["r1"], "", ["a"]) == {"r1": 0}
    index._apply("r1", 1, EventBatch(0.0, prompt_blocks("", ["a"], 1)))  # on its way from before the reset
    assert index.holding(["r1"], "", ["a"]) == {"r1": 0}
    index._apply("r1", 2, EventBatch(0.0, [*prompt_blocks("", ["b"], 20), _Cleared(), *prompt_blocks("", ["c"], 30)]))
    assert index.holding(["r1"], "", ["b"]) == {"r1": 0} and index.holding(["r1"], "", ["c"]) == {"r1": 1}


# --- the routing rule with events as data ---------------------------------------------------------------------

def test_events_override_what_the_table_learned_and_cover_only_the_replicas_they_know():
    p = PromptPlan(images=(sample_key(),), text="q")
    replicas = ["r1", "r2", "r3"]
    queues = dict.fromkeys(replicas, 0)
    order = rendezvous_order(route_key(p), replicas)
    table = AffinityTable()
    sent_to = order[-1]  # not the plan's home: only the table makes it first
    table.record(sent_to, prefix_path(p))
    assert rank_replicas(p, queues, table, bound=8)[0] == sent_to
    # Its events say it evicted the page and another replica holds it: that one leads.
    holder = order[1]
    assert rank_replicas(p, queues, table, 8, {sent_to: 0, holder: 1, order[0]: 0})[0] == holder
    # Every replica's events say none holds it: the rendezvous home, whatever the table learned.
    assert rank_replicas(p, queues, table, 8, dict.fromkeys(replicas, 0))[0] == order[0]
    # Events known for one replica only: the others are the table's, so the one the table learned still leads.
    assert rank_replicas(p, queues, table, 8, {holder: 0})[0] == sent_to
    # A holder past the queue bound gives way to the least loaded, as by the table.
    assert rank_replicas(p, {**queues, holder: 9, order[0]: 1}, table, 8, {holder: 1})[0] == sent_to


def sample_key() -> ImageKey:
    return ImageKey(ContentHash(hashlib.sha256(b"page").hexdigest()), EncoderVersion("ab" * 8),
                    ResolutionPolicy(3136, 200704))


# --- the subscriber against vLLM's own publisher -------------------------------------------------------------

class Publisher:
    """vLLM's ZmqEventPublisher on a free port, as an engine core runs it (no engine: the batches are ours)."""

    def __init__(self, port: int | None = None, buffer_steps: int = 10_000) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.port = port or free_port_pair()
        config = publisher_config(f"tcp://*:{self.port}")
        self.pub = ZmqEventPublisher(0, endpoint=config["endpoint"], replay_endpoint=config["replay_endpoint"],
                                     buffer_steps=buffer_steps)

    @property
    def endpoint(self) -> str:
        return f"tcp://*:{self.port}"

    def send(self, *events) -> None:
        """Publish one batch and return once it is sent and in the replay buffer. vLLM's publish() only queues it
        for the publisher's thread: a subscriber connecting right after four sends could ask for a replay while
        the thread had buffered two of them, and find a history that was meant to be gone."""
        from vllm.distributed.kv_events import KVEventBatch

        self.pub.publish(KVEventBatch(ts=0.0, events=[vllm_event(e) for e in events]))
        # The thread calls task_done() once the batch is on the PUB socket and appended to the buffer.
        eventually_sync(lambda: self.pub._event_queue.unfinished_tasks == 0, timeout=WAIT_S,
                        what="the publisher's thread sent and buffered the batch")

    def close(self) -> None:
        self.pub.shutdown()


def vllm_event(event):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    if isinstance(event, _Stored):
        return BlockStored(block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash, token_ids=[],
                           block_size=32, lora_id=None, medium="GPU", lora_name=None,
                           extra_keys=[tuple(tuple(k) if isinstance(k, list) else k for k in keys) if keys else None
                                       for keys in event.extra_keys or []] or None)
    if isinstance(event, _Removed):
        return BlockRemoved(block_hashes=event.block_hashes, medium="GPU")
    return AllBlocksCleared()


def synced_with(index: KvEventIndex, replica: str, images: list[str], n: int):
    return index.wait(lambda v: v.state(replica) is State.SYNCED and v.match(replica, "", images) == n, WAIT_S)


def test_the_subscriber_replays_what_it_missed_before_connecting_and_follows_what_comes_after():
    pub = Publisher()
    sub = None
    try:
        for event in prompt_blocks("", ["a"], 1):
            pub.send(event)  # published before anyone listens: only the replay has it
        sub = KvEventSubscriber({"r1": pub.endpoint})
        assert synced_with(sub.index, "r1", ["a"], 1), sub.index.stats()
        pub.send(*prompt_blocks("", ["b"], 10))
        assert synced_with(sub.index, "r1", ["b"], 1), sub.index.stats()
        pub.send(_Removed(block_hashes=[11], medium="GPU"))
        assert synced_with(sub.index, "r1", ["b"], 0), sub.index.stats()
        assert sub.index.stats()["r1"]["events"] == 3 and sub.index.stats()["r1"]["resyncs"] == 1
    finally:
        if sub:
            sub.close()
        pub.close()


def test_a_lost_publisher_marks_its_replica_lost_and_a_restarted_one_is_rebuilt_from_its_own_history():
    pub = Publisher()
    sub = KvEventSubscriber({"r1": pub.endpoint})
    try:
        pub.send(*prompt_blocks("", ["a"], 1))
        assert synced_with(sub.index, "r1", ["a"], 1)
        pub.close()  # the replica died
        assert sub.index.wait(lambda v: v.state("r1") is State.LOST, WAIT_S), sub.index.stats()
        assert sub.index.holding(["r1"], "", ["a"]) == {}  # routing asks the table now, and the metrics say so
        assert 'mmrag_kv_events_synced{replica="r1",state="lost"} 0.0' in scrape(sub)
        pub = Publisher(port=pub.port)  # restarted on the same port: an empty cache, its sequence from 0
        pub.send(*prompt_blocks("", ["c"], 40))
        assert synced_with(sub.index, "r1", ["c"], 1), sub.index.stats()
        assert sub.index.holding(["r1"], "", ["a"]) == {"r1": 0}  # the old process's blocks are gone
    finally:
        sub.close()
        pub.close()


def drop(pub: Publisher, *events) -> None:
    """A batch the publisher numbered and kept for replay but no subscriber got: a SUB socket drops what comes past
    its high-water mark. Called while the publisher's thread is idle (it is the one other user of both)."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    seq = next(pub.pub._seq_gen)
    pub.pub._buffer.append((seq, msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[vllm_event(e) for e in events]))))


def test_a_gap_in_the_sequence_is_replayed_from_the_first_batch_missing():
    pub = Publisher()
    sub = None
    try:
        pub.send(*prompt_blocks("", ["p"], 1))  # batch 0, before anyone listens: only the replay on connecting has it
        sub = KvEventSubscriber({"r1": pub.endpoint})
        assert synced_with(sub.index, "r1", ["p"], 1), sub.index.stats()
        drop(pub, *prompt_blocks("", ["a"], 10))  # batch 1, lost on the way
        pub.send(*prompt_blocks("", ["b"], 20))  # batch 2: a gap before it, replayed first
        assert synced_with(sub.index, "r1", ["b"], 1), sub.index.stats()
        assert sub.index.holding(["r1"], "", ["a"]) == {"r1": 1}, sub.index.stats()
        assert sub.index.stats()["r1"]["resyncs"] == 2  # on connecting, and for the gap
    finally:
        if sub:
            sub.close()
        pub.close()


def test_a_history_the_publisher_no_longer_buffers_leaves_the_replica_unknown_until_its_reset():
    pub = Publisher(buffer_steps=2)
    sub = None
    try:
        for i in range(4):  # batches 0-3; the buffer keeps 2-3
            pub.send(*prompt_blocks("", [f"x{i}"], 100 * i))
        sub = KvEventSubscriber({"r1": pub.endpoint})
        assert sub.index.wait(lambda v: v.state("r1") is State.UNKNOWN, WAIT_S), sub.index.stats()
        assert sub.index.holding(["r1"], "", ["x3"]) == {}  # not the events' word: the table's
        pub.send(_Cleared())  # the replica's cache reset: from here on its events say everything
        pub.send(*prompt_blocks("", ["y"], 900))
        assert synced_with(sub.index, "r1", ["y"], 1), sub.index.stats()
        assert sub.index.holding(["r1"], "", ["x3"]) == {"r1": 0}
    finally:
        if sub:
            sub.close()
        pub.close()


def test_a_subscriber_following_no_replica_waits_instead_of_spinning():
    """zmq's poll over no socket returns at once: a subscriber with no replica (Ray's, before the first or after the
    last) spun a core at 100% and made every CPU-bound test after the Ray module ten times slower."""
    sub = KvEventSubscriber()
    try:
        sub.index.wait(lambda v: False, 0.5)  # half a second of following nothing: ~5 turns of 100 ms, not millions
        assert sub.turns <= 50, sub.turns
        sub.add("r1", f"tcp://*:{free_port_pair()}")
        sub.discard("r1")  # and after its last replica is gone
        before = sub.turns
        sub.index.wait(lambda v: False, 0.5)
        assert sub.turns - before <= 50, sub.turns - before
    finally:
        sub.close()


def test_the_publishers_config_is_what_vllm_takes_and_its_replay_sits_on_the_next_port():
    from vllm.config import KVEventsConfig

    config = KVEventsConfig(**publisher_config("tcp://*:5557"))
    assert config.enable_kv_cache_events and config.replay_endpoint == "tcp://*:5558"
    assert replay_endpoint("ipc:///run/kv") == "ipc:///run/kv-replay"


def scrape(sub: KvEventSubscriber) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from serving.metrics import Metrics

    metrics = Metrics(CollectorRegistry())
    metrics.register_kv_events(sub.index.stats, {"table": 1})
    return generate_latest(metrics.registry).decode()


# --- `mmrag bench --kv-events`: its sizing and its verdicts (the runs themselves need replicas) -----------------

def test_the_pressure_scenarios_kv_holds_a_third_of_the_working_set_but_one_longest_prompt_at_least():
    from mmrag.bench.kv_events import pressure_config
    from mmrag.bench.runner import default_engine_config

    config = default_engine_config()  # 32-token blocks, 4,096-token model length
    pressed = pressure_config(config, working_set_tokens=96_000, longest_prompt_tokens=1_000)
    assert pressed.kv_blocks == 1000 and pressed.max_model_len == 1024  # 96,000 / 3 / 32; the prompt in blocks
    small = pressure_config(config, working_set_tokens=3_000, longest_prompt_tokens=1_000)
    assert small.kv_blocks == 33  # a third would be 32 blocks: vLLM starts only with one longest prompt's and one


def test_the_verdicts_compare_events_with_the_steady_run_the_table_and_one_replica():
    from mmrag.bench.kv_events import kv_events_table, targets

    def run(events: float, table: float) -> dict:
        row = dict(ttft_p50_s=0.1, ttft_p99_s=0.2, plans_per_s=1.0, routes_by_events=1)
        return {"events": {"image_prefix_hit_rate": events, **row}, "table": {"image_prefix_hit_rate": table, **row}}

    scenarios = {"a_steady": {**run(0.5, 0.5), "single": {"image_prefix_hit_rate": 0.5}},
                 "b_kv_pressure": run(0.4, 0.4), "c_two_routers": run(0.5, 0.4), "d_reset": run(0.46, 0.46),
                 "e_replica_joins": run(0.6, 0.3)}
    t = targets(scenarios)
    assert t["events_vs_steady"] == {"b_kv_pressure": 0.8, "c_two_routers": 1.0, "d_reset": 0.92}
    assert not t["events_within_0_9_of_steady"]  # b is at 0.8
    assert t["events_over_table"] == {"b_kv_pressure": 1.0, "c_two_routers": 1.25}
    assert t["events_1_2x_table_in_b_or_c"] and t["a_table_of_single"] == 1.0 and t["e_events_over_table"] == 2.0
    scenarios["a_steady"]["single"].update(ttft_p50_s=0.1, ttft_p99_s=0.2, plans_per_s=1.0, routes_by_events=0)
    text = kv_events_table({"vllm_serve": {"scenarios": scenarios, "targets": t}})
    assert "| vllm_serve | c_two_routers | events | 0.5 |" in text and "e (a replica joins): events / table 2.0" in text
