"""The draft worker's thread between foreground jobs (draft/jobs.py, JobWorker._next): a job that
arrives while a background slice finishes runs before the next slice is launched, not after its
host work (docs/architecture.md, "Overlapped drafting": an asked answer waited 0.97 ms for the
worker's thread in process on two H200s)."""

from __future__ import annotations

from concurrent.futures import Future

from specextend.draft.job_types import Close
from specextend.draft.jobs import JobWorker


class Driven(JobWorker):
    """A worker whose loop the test drives (`_next` on the test's thread); one slice in flight."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.flying = True
        self.arrives_on_finish = True
        super().__init__("driven")

    def _run(self) -> None:  # no loop of its own
        pass

    def _in_flight(self) -> bool:
        if self.flying:
            self.flying = False
            self.events.append("finished")
            if self.arrives_on_finish:  # a step reaches the queue while the slice's bookkeeping runs
                self._jobs.put((Close("s"), Future()))
        return False

    def _background(self) -> bool:
        self.events.append("launched")
        self.flying = True
        return True


def test_a_job_that_came_while_a_slice_finished_runs_before_the_next_launch():
    w = Driven()
    job, _ = w._next()
    assert isinstance(job, Close) and w.events == ["finished"]


def test_a_queued_job_goes_before_the_slice_is_even_finished():
    w = Driven()
    w.arrives_on_finish = False
    w._jobs.put((Close("t"), Future()))
    job, _ = w._next()
    assert job.session_id == "t" and w.events == [] and w.flying  # the slice finishes after the job
