"""Review of the parallel engine's leader / follower protocol (issue 19): behaviours that must match one process,
and failures that must end every rank promptly. One DP=2 engine with experts over both ranks per scenario, the
scenarios run at once with test_parallel_engine.py's killed / hung ranks (tests/parallel/conftest.py).

"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def review(failure_scenarios) -> dict:
    return failure_scenarios  # run at once with the killed / hung rank cases (tests/parallel/conftest.py)


def test_a_leader_only_failure_after_the_broadcast_stops_every_rank(review):
    """The leader's own replica raising a DeepInferError in a step the followers already run: the engine stops
    at once (followers killed, not left in a collective the leader never joins), has_unfinished_requests raises
    instead of a stale True a server loop would spin on, and a later step fails at once (no collective
    against ranks still inside the failed step)."""
    got = review["review"]
    assert got["fault"].startswith("DeepInferError: the parallel engine stopped"), got
    assert "injected" in got["fault"], got
    assert got["children_alive_after_fault"] == [False], got
    assert got["unfinished_after_fault"].startswith("DeepInferError: the parallel engine stopped"), got
    assert got["later_step"].startswith("DeepInferError: the parallel engine stopped"), got
    assert got["later_step_s"] < 1.0, got


def test_has_unfinished_right_after_aborting_a_request_on_another_replica(review):
    """One process answers False once every request is aborted; the leader knows every request on the other
    replica, so it needs no report of a later step to say the same."""
    assert review["review"]["unfinished_after_aborts"] is False, review["review"]


def test_a_rank_killed_before_the_rendezvous_ends_start_up_at_once(review):
    """A spawned rank that dies before joining (killed right after its spawn): the leader names it within
    seconds instead of waiting out the start-up timeout (600 s) in the rendezvous."""
    got = review["kill_at_start"]
    assert "rank 1 (exit code -9) stopped before joining" in got["error"], got
    assert got["error_after_kill_s"] is not None and got["error_after_kill_s"] < 5.0, got


def test_a_rank_hung_while_idle_is_stopped_and_shutdown_is_prompt(review):
    """The heartbeat finds a SIGSTOPped rank while the leader is idle: the rank is stopped then (not left holding
    its device), and shutdown() does not wait 30 s for a rank that never got a stop command."""
    got = review["idle_hang"]
    assert got["broken"] and "stopped answering" in got["broken"], got
    assert got["child_alive_before_shutdown"] is False, got
    assert got["shutdown_s"] < 5.0, got
    assert got["child_alive_after_shutdown"] is False, got


def test_generate_refuses_while_another_replicas_request_is_unfinished(review):
    got = review["review"]
    assert got["generate_with_remote_pending"].startswith("DeepInferError: generate() cannot run"), got
    assert got["b_finished_output_seen"] is True, got


def test_abort_of_a_request_on_another_replica_returns_its_last_state(review):
    assert review["review"]["remote_abort_finish_reason"] == "abort", review["review"]
