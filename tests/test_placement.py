"""Placement rules (pure, no Ray): what a worker reserves, where it goes, when a
request can never fit."""

import random
from collections import Counter

import pytest

from dpex._placement import (
    Node,
    choose_nodes,
    matches,
    never_fits,
    per_worker_demand,
    reserves,
    shortfall,
)


@pytest.mark.parametrize("args, expected", [
    ({}, False),
    ({"runtime_env": {"pip": []}}, False),
    ({"num_cpus": 0}, False),
    ({"resources": {"prep": 0}}, False),
    ({"num_cpus": 1}, True),
    ({"num_cpus": 0.25}, True),
    ({"num_gpus": 1}, True),
    ({"memory": 1 << 30}, True),
    ({"resources": {"prep": 1}}, True),
    ({"scheduling_strategy": "SPREAD"}, True),
])
def test_only_what_the_user_asks_for_is_a_reservation(args, expected):
    assert reserves(args) is expected


def test_per_worker_demand_uses_rays_resource_names():
    assert per_worker_demand({}) == {}
    assert per_worker_demand({"num_cpus": 2, "num_gpus": 0.5, "memory": 10,
                              "resources": {"prep": 1, "none": 0}}) == \
        {"CPU": 2.0, "GPU": 0.5, "memory": 10.0, "prep": 1.0}


def test_workers_spread_over_cpu_nodes_in_proportion_to_their_cpus():
    nodes = [Node("head", 0), Node("small", 2), Node("big", 6)]
    chosen = choose_nodes(nodes, {}, 8, random.Random(0))
    assert Counter(chosen) == {"small": 2, "big": 6}  # none on the node without CPUs


def test_live_workers_of_other_loaders_count():
    nodes = [Node("a", 4), Node("b", 4)]
    chosen = choose_nodes(nodes, {"a": 4}, 4, random.Random(0))
    assert Counter(chosen) == {"b": 4}


def test_ties_are_broken_at_random_so_ranks_do_not_pile_up():
    nodes = [Node(f"n{i}", 8) for i in range(4)]
    firsts = {choose_nodes(nodes, {}, 1, random.Random(seed))[0] for seed in range(40)}
    assert len(firsts) > 1


def test_with_no_cpu_node_ray_chooses():
    assert choose_nodes([Node("gpu-only", 0)], {}, 3, random.Random(0)) == [None] * 3


def test_never_fits_on_a_static_cluster():
    totals, largest = {"CPU": 4.0}, {"CPU": 2.0}
    assert never_fits({"CPU": 1}, 4, totals, largest, None) is None
    assert never_fits({"CPU": 1}, 5, totals, largest, None) == "CPU: 5 asked, 4 in the cluster"
    assert never_fits({"CPU": 3}, 1, totals, largest, None) == \
        "CPU: 3 asked per worker, the largest node has 2"
    assert never_fits({"prep": 1}, 1, totals, largest, None) == \
        "prep: 1 asked per worker, the largest node has 0"


def test_an_autoscaling_cluster_is_judged_by_what_it_may_grow_to():
    # Today: one 2-CPU node. The autoscaler may add up to 64 CPUs.
    totals, largest, most = {"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 64.0}
    assert never_fits({"CPU": 1}, 32, totals, largest, most) is None
    assert never_fits({"CPU": 4}, 2, totals, largest, most) is None
    assert never_fits({"CPU": 1}, 65, totals, largest, most) == \
        "CPU: 65 asked, at most 64 after autoscaling"


def test_pending_requests_and_shortfall():
    assert matches({"CPU": 1.0}, {"CPU": 1.0, "memory": 5.0})
    assert not matches({"CPU": 1.0}, {"CPU": 2.0})
    assert not matches({"prep": 1.0}, {"CPU": 1.0})
    assert shortfall({"CPU": 1.0, "prep": 1.0}, {"CPU": 0.5, "prep": 3.0}) == {"CPU": 0.5}
    assert shortfall({"CPU": 1.0}, {"CPU": 1.0}) == {}
