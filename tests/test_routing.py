"""The routing rule (serving/routing.py), pure: no replica, no server."""

from __future__ import annotations

import pytest

from mmrag.core.engine import PromptPlan
from mmrag.core.settings import Settings
from serving.routing import AffinityTable, choose_replica, prefix_path, rank_replicas, rendezvous_order, route_key

A, B, C = "replica-a", "replica-b", "replica-c"
BOUND = Settings().ray.affinity_queue_bound


def plan(*images: str, system: str = "default", text: str = "q") -> PromptPlan:
    return PromptPlan(images=images, text=text, system_prompt_id=system)  # type: ignore[arg-type]


def idle(*replicas: str) -> dict[str, int]:
    return {r: 0 for r in replicas}


def test_with_no_history_a_plan_goes_to_its_rendezvous_home():
    table = AffinityTable()
    for i in range(50):
        p = plan(f"fig{i}", "fig-x")
        assert choose_replica(p, idle(A, B, C), table, BOUND) == rendezvous_order(f"fig{i}", [A, B, C])[0]
    assert choose_replica(plan("f"), {}, table, BOUND) is None


def test_the_holder_of_the_longest_image_prefix_wins_over_the_rendezvous_home():
    table = AffinityTable()
    home = rendezvous_order("f1", [A, B])[0]
    other = B if home == A else A
    table.record(home, prefix_path(plan("f1")))
    table.record(other, prefix_path(plan("f1", "f2", "f3")))
    assert choose_replica(plan("f1", "f2", "f9"), idle(A, B), table, BOUND) == other  # holds 2 images, home 1
    # Both hold f1 (one image): the tie goes to the shorter queue.
    assert choose_replica(plan("f1", "f7"), {home: 0, other: 3}, table, BOUND) == home
    assert choose_replica(plan("f1", "f7"), {home: 3, other: 0}, table, BOUND) == other
    assert table.match(other, prefix_path(plan("f1", "f2", "f9"))) == 3  # system + 2 images


def test_a_prefix_is_held_only_after_the_same_system_prompt():
    table = AffinityTable()
    home = rendezvous_order("f1", [A, B])[0]
    other = B if home == A else A
    table.record(other, prefix_path(plan("f1", system="synthesize")))
    assert choose_replica(plan("f1"), idle(A, B), table, BOUND) == home
    assert choose_replica(plan("f1", system="synthesize"), idle(A, B), table, BOUND) == other


def test_plans_without_images_route_by_their_system_prompt():
    table = AffinityTable()
    assert route_key(plan()) == "system:default"
    home = rendezvous_order("system:decompose", [A, B])[0]
    other = B if home == A else A
    assert choose_replica(plan(system="decompose"), idle(A, B), table, BOUND) == home
    table.record(other, prefix_path(plan(system="decompose")))
    assert choose_replica(plan(system="decompose", text="another"), idle(A, B), table, BOUND) == other
    # Holding the system prompt is no image prefix: a plan with images is not drawn to it.
    table.record(other, prefix_path(plan(system="default")))
    assert table.match(other, prefix_path(plan("f5"))) == 0


def test_a_home_past_the_queue_bound_gives_way_to_the_least_loaded():
    table = AffinityTable()
    table.record(A, prefix_path(plan("f1")))
    assert choose_replica(plan("f1"), {A: BOUND, B: 0, C: 2}, table, BOUND) == A  # at the bound: still home
    assert rank_replicas(plan("f1"), {A: BOUND + 1, B: 5, C: 2}, table, BOUND) == [C, B, A]
    home = rendezvous_order("new", [A, B, C])[0]
    assert choose_replica(plan("new"), {**idle(A, B, C), home: BOUND + 1}, table, BOUND) != home


def test_the_ranking_lists_every_live_replica_once_home_first():
    table = AffinityTable()
    table.record(B, prefix_path(plan("f1")))
    ranked = rank_replicas(plan("f1"), {A: 4, B: 1, C: 0}, table, BOUND)
    assert ranked == [B, C, A]


def test_replicas_come_and_go():
    table = AffinityTable()
    table.record(A, prefix_path(plan("f1")))
    table.record(B, prefix_path(plan("f2")))
    assert choose_replica(plan("f1"), idle(B, C), table, BOUND) in {B, C}  # A is gone: its entries mean nothing
    table.drop(A)
    assert table.match(A, prefix_path(plan("f1"))) == 0
    table.retain([C])
    assert table.replicas() == []
    # Adding a replica moves only the new keys that rank it first (rendezvous); held keys stay put.
    table.record(A, prefix_path(plan("f1")))
    assert choose_replica(plan("f1"), idle(A, B, C), table, BOUND) == A


def test_the_table_forgets_the_least_recently_sent_prefixes_first():
    table = AffinityTable(capacity=4)
    for i in range(4):
        table.record(A, prefix_path(plan(f"f{i}")))
    table.record(A, prefix_path(plan("f0")))  # sent again: most recent
    table.record(A, prefix_path(plan("f9")))
    assert table.match(A, prefix_path(plan("f1"))) == 0
    assert table.match(A, prefix_path(plan("f0"))) == 2
    assert table.match(A, prefix_path(plan("f9"))) == 2


@pytest.mark.slow
def test_the_plain_serve_path_does_not_import_ray():
    # `mmrag serve` without --ray must not pay Ray's import time: Ray is imported inside serving/ray only.
    import subprocess
    import sys

    code = ("import sys, mmrag.wiring, mmrag.cli, serving.engine.remote, serving.routing, serving.api.main; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_cache_salt_is_part_of_the_route_and_of_what_a_replica_holds():
    """Two tenants' plans of one figure share no KV (their salts differ), so neither is drawn to the replica
    holding the other's prefix, and each salt has its own rendezvous home. The default tenant's empty salt
    keeps the keys an unsalted deployment always had."""
    import dataclasses

    acme = dataclasses.replace(plan("f1"), cache_salt="tenant-acme")
    assert route_key(plan("f1")) == "f1" and route_key(acme) == "tenant-acmef1"
    table = AffinityTable()
    home = rendezvous_order(route_key(acme), [A, B])[0]
    other = B if home == A else A
    table.record(other, prefix_path(plan("f1")))  # the default tenant's prefill of f1
    assert choose_replica(acme, idle(A, B), table, BOUND) == home
    table.record(home, prefix_path(acme))
    assert table.match(home, prefix_path(plan("f1"))) == 0 and table.match(other, prefix_path(acme)) == 0
