"""Admission and quotas of a shared cluster (`JobBook`, no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlix.cluster.jobs import Job, JobBook, PipelineNeeds, Quotas
from rlix.errors import ConfigError


def job(name: str, user: str = "ann", *, min_shards: int = 1, max_shards: int = 2, tp: int = 1,
        overlap: bool = True, pipelines: int = 1) -> Job:
    return Job(name=name, user=user, pipelines=[
        PipelineNeeds(f"{name}-{i}" if pipelines > 1 else name, 1, tp, min_shards, max_shards, overlap)
        for i in range(pipelines)])


def test_minimum_and_most_follow_the_scheduler_promises():
    assert PipelineNeeds("p", 1, 1, 1, 2, True).minimum == 1  # trains where its shards sleep
    assert PipelineNeeds("p", 1, 1, 1, 2, False).minimum == 2  # a training home of its own
    assert PipelineNeeds("p", 2, 2, 2, 3, True).minimum == 4
    assert PipelineNeeds("p", 1, 1, 0, 2, True).minimum == 1  # at least one shard
    assert PipelineNeeds("p", 2, 2, 1, 3, True).most == 8


def test_jobs_are_admitted_while_their_floors_fit_then_queue_in_order():
    book = JobBook(3)
    for name in ("a", "b", "c"):
        assert book.submit(job(name, user=name)).state == "admitted"
    d = book.submit(job("d", user="d"))
    e = book.submit(job("e", user="e"))
    assert (d.state, e.state) == ("queued", "queued")
    assert book.position("d") == 1 and book.position("e") == 2
    assert "needs 1 GPU(s) as its minimum; 3 of the cluster's 3 are promised" in d.reason
    book.set_state("a", "running")
    book.set_state("a", "done")  # its floor is free: the first in the queue goes
    assert (book.get("d").state, book.get("e").state) == ("admitted", "queued")
    assert book.position("e") == 1


def test_a_smaller_job_may_pass_one_that_does_not_fit_but_not_its_own_users_earlier_one():
    book = JobBook(3)
    book.submit(job("a", user="x"))
    big = book.submit(job("big", user="y", min_shards=3, max_shards=3))
    assert big.state == "queued"
    small = book.submit(job("small", user="z"))
    assert small.state == "admitted"  # fits beside a; big still waits
    after = book.submit(job("after", user="y"))
    assert after.state == "queued" and "earlier job of user 'y' waits" in after.reason


def test_user_caps_count_what_admitted_jobs_may_hold():
    book = JobBook(8, Quotas({"carol": 4}, default=None))
    assert book.submit(job("c1", user="carol", max_shards=1)).state == "admitted"  # may hold 2
    assert book.submit(job("c2", user="carol", max_shards=1)).state == "admitted"  # 4 of 4
    c3 = book.submit(job("c3", user="carol", max_shards=1))
    assert c3.state == "queued" and "user 'carol' is at 4 of a 4-GPU cap" in c3.reason
    assert book.submit(job("d1", user="dave", max_shards=3)).state == "admitted"  # no cap for dave
    book.get("c1").driver_pid = 4242  # its driver attached
    book.cancel("c1")  # running jobs are asked to stop; their drivers end them
    assert book.get("c1").cancel_requested and book.get("c1").state == "admitted"
    book.set_state("c1", "cancelled")
    assert book.get("c3").state == "admitted"


def test_jobs_that_could_never_run_or_clash_are_refused_at_submit():
    book = JobBook(2, Quotas(default=3))
    with pytest.raises(ConfigError, match="needs at least 3 GPUs; the cluster has 2"):
        book.submit(job("huge", min_shards=3, max_shards=3))
    with pytest.raises(ConfigError, match="may hold up to 5 GPUs; user 'ann' is capped at 3"):
        book.submit(job("wide", max_shards=4))
    book.submit(job("a"))
    with pytest.raises(ConfigError, match="already admitted"):
        book.submit(job("a"))
    with pytest.raises(ConfigError, match=r"pipeline name\(s\) \['a'\] are in use by job\(s\) \['a'\]"):
        book.submit(Job(name="other", user="ann", pipelines=[PipelineNeeds("a", 1, 1, 1, 1)]))


def test_cancel_of_a_queued_job_ends_it_and_jobs_are_found_by_pipeline_name():
    book = JobBook(2)
    book.submit(job("a"))
    queued = book.submit(job("two", pipelines=2))
    assert queued.state == "queued"
    assert book.find("two-1").name == "two"
    assert book.cancel("two-0").state == "cancelled"
    assert book.queue() == []
    with pytest.raises(ConfigError, match="no job 'nope'"):
        book.find("nope")
    rows = book.rows()
    assert [(r["name"], r["state"], r["queue_position"]) for r in rows] == [("a", "admitted", None),
                                                                          ("two", "cancelled", None)]


def test_cancel_of_an_admitted_job_whose_driver_never_attached_ends_it_at_once():
    """Its client died before starting the driver (or the driver before joining): nothing would
    ever see a cancel flag, and its floor would hold the queue (and `rlix down` for its drain)."""
    book = JobBook(1)
    book.submit(job("a", max_shards=1))
    waiting = book.submit(job("b", max_shards=1))
    assert book.get("a").state == "admitted" and waiting.state == "queued"
    ended = book.cancel("a")
    assert (ended.state, ended.reason, ended.cancel_requested) == ("cancelled", "cancelled before its driver "
                                                                                "started", False)
    assert book.get("b").state == "admitted"  # its floor went to the queue


def test_a_job_whose_driver_died_is_failed_and_its_place_goes_to_the_queue():
    book = JobBook(2)
    book.submit(job("a", max_shards=2))
    book.submit(job("b", max_shards=2))
    book.submit(job("c", max_shards=2))
    assert book.get("c").state == "queued"
    for name, pid in (("a", 101), ("b", 102)):
        book.get(name).driver_pid, book.get(name).driver_host = pid, "here"
    book.get("c").driver_pid, book.get("c").driver_host = 103, "elsewhere"  # not ours to judge
    dead = {101, 103}
    lost = book.lost_drivers(lambda pid: pid not in dead, "here")
    assert lost == ["a"]
    book.set_state("a", "failed", "its driver died")
    assert book.get("c").state == "admitted"  # a's floor went to the queue
    assert book.lost_drivers(lambda pid: pid not in dead, "here") == []  # failed jobs are not live


def test_rlix_down_outwaits_a_drivers_own_bound_on_stopping_its_pipelines():
    """The head must never SIGKILL a driver that is still inside its own stop bound (its summary
    and checkpoints would be lost), and `rlix down` must outwait the head's drain."""
    from rlix.cluster.commands import DOWN_TIMEOUT_S
    from rlix.cluster.head import DRAIN_TIMEOUT_S
    from rlix.supervise import STOP_TIMEOUT_S, SUMMARY_TIMEOUT_S

    assert DRAIN_TIMEOUT_S > STOP_TIMEOUT_S + SUMMARY_TIMEOUT_S + 30  # + the summary and timeline
    assert DOWN_TIMEOUT_S > DRAIN_TIMEOUT_S + 30  # + Ray's shutdown


def test_ended_jobs_of_an_earlier_life_are_listed_never_admitted_and_round_trip():
    from rlix.cluster.jobs import book_file_text, end_unfinished, read_book_file

    book = JobBook(total_gpus=2)
    running = job("a", "ann", min_shards=1)
    book.submit(running)
    book.set_state("a", "running")
    records = [j.record() for j in book.jobs.values()]
    assert end_unfinished(records, "the cluster's head (pid 7) was killed by signal 9 (SIGKILL)") == 1
    assert records[0]["reason"] == "the cluster's head (pid 7) was killed by signal 9 (SIGKILL) while the job was running"
    later = JobBook(total_gpus=2)
    later.restore_ended([Job.from_record(r) for r in records])
    row = later.row("a")
    assert row["state"] == "failed" and row["queue_position"] is None and later.live() == []
    assert later.submit(job("a", "ann", min_shards=1)).state == "admitted"  # an ended name is free again
    with pytest.raises(ValueError, match="only ended jobs"):
        JobBook(total_gpus=2).restore_ended([Job.from_record({**records[0], "state": "running"})])
    assert read_book_file(Path("/nonexistent/jobs.json")) == []
    assert [Job.from_record(r) for r in json.loads(book_file_text(records))["jobs"]][0].pipelines == running.pipelines
