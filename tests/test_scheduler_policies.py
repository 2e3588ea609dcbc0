"""Scheduling policies as objects: one class per ``SchedulerConfig.policy``, chosen once."""

from __future__ import annotations

import pytest

from parrot.manager.dag.objectives import CallObjective
from parrot.manager.sched.policies import (
    POLICY_CLASSES,
    LatencyBaselinePolicy,
    NoAffinityPolicy,
    NoDeductionPolicy,
    ParrotPolicy,
    ThroughputBaselinePolicy,
    policy_for,
)
from parrot.manager.sched.scheduler import POLICIES, QueuedCall, Scheduler, SchedulerConfig

GROUP = QueuedCall("c", "m", CallObjective("throughput", "tg:x", "test"))


def test_every_configurable_policy_has_its_class():
    assert set(POLICY_CLASSES) == set(POLICIES)
    for name, cls in POLICY_CLASSES.items():
        assert cls.name == name
        assert type(policy_for(SchedulerConfig(name))) is cls


def test_the_scheduler_builds_its_policy_once_from_its_config():
    sched = Scheduler(SchedulerConfig("no-affinity"))
    policy = sched.policy
    sched.schedule([])
    assert sched.policy is policy and isinstance(policy, NoAffinityPolicy)
    assert isinstance(Scheduler().policy, ParrotPolicy)


@pytest.mark.parametrize(
    ("policy", "work"),
    [
        ("parrot", ("throughput", "tg:x")),
        ("no-affinity", ("throughput", "tg:x")),
        ("no-deduction", ("latency", None)),
        ("baseline-latency", ("latency", None)),
        ("baseline-throughput", ("throughput", None)),
    ],
)
def test_what_work_a_call_is_under_each_policy(policy, work):
    assert policy_for(SchedulerConfig(policy)).work_of(GROUP) == work


def test_caps_per_policy():
    # kind, engine mode, capacity 1000, latency cap 300
    lat = LatencyBaselinePolicy(SchedulerConfig("baseline-latency"))
    assert lat.cap("throughput", None, 1000, 300) == 300
    thr = ThroughputBaselinePolicy(SchedulerConfig("baseline-throughput", throughput_cap=800))
    assert thr.cap("latency", "latency", 1000, 300) == 800
    paper = ParrotPolicy(SchedulerConfig())
    assert paper.cap("throughput", "latency", 1000, 300) == 300  # next to latency work
    assert paper.cap("throughput", None, 1000, 300) == 1000
    mixed = ParrotPolicy(SchedulerConfig(latency_cap_scope="mixed"))
    assert mixed.cap("latency", "latency", 1000, 300) == 1000  # latency work batches
    assert mixed.cap("throughput", "latency", 1000, 300) == 300


def test_saturation_batching_is_parrots_under_the_scope_all_only():
    assert ParrotPolicy(SchedulerConfig(saturation_batching=True)).batching is not None
    assert NoDeductionPolicy(SchedulerConfig("no-deduction", saturation_batching=True)).batching is not None
    assert ParrotPolicy(SchedulerConfig(saturation_batching=True, latency_cap_scope="mixed")).batching is None
    assert not hasattr(policy_for(SchedulerConfig("baseline-latency", saturation_batching=True)), "batching")
