"""The draft worker hands an answer over before its next work (jobs.py, `submit(handover=...)`;
docs/architecture.md, "Wire protocol"): a transport that sends answers from its own thread gets the
GIL while it does, instead of waiting for the worker's next Python (a ready step's K/V moves, a
background launch) to let go of it."""

from __future__ import annotations

import threading
import time

import pytest

from specextend.draft.base import DraftBackend, DraftSessionParams, DraftTree
from specextend.draft.jobs import Open, SerialDraft, Step

WAIT_S = 0.3  # the bound in these tests: far above any scheduling delay of a loaded machine


class Null(DraftBackend):
    def open(self, session_id, prompt_ids, params):
        pass

    def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
        return DraftTree(step=step, tokens=(5,), parents=(-1,))

    def close(self, session_id):
        pass


class Recording(SerialDraft):
    """Notes when the thread goes on to its next work after each job."""

    def __init__(self) -> None:
        self.next_work: list[float] = []
        super().__init__(Null())

    def _run_job(self, job, fut) -> None:
        super()._run_job(job, fut)
        self.next_work.append(time.perf_counter())


def _after(worker: Recording, n: int) -> float:
    deadline = time.monotonic() + 5
    while len(worker.next_work) < n and time.monotonic() < deadline:
        time.sleep(0.0005)
    return worker.next_work[n - 1]


@pytest.fixture
def worker():
    w = Recording()
    w.handover_wait_s = WAIT_S
    w.submit(Open("s", (1, 2, 3), DraftSessionParams())).result()
    yield w
    w.shutdown()


def test_the_worker_goes_on_only_once_the_answer_is_sent(worker):
    sent = threading.Event()
    fut = worker.submit(Step("s", 0, (1,)), handover=sent)
    assert fut.result(timeout=5).tokens == (5,)  # answered, the worker waiting
    time.sleep(WAIT_S / 10)
    assert len(worker.next_work) == 1  # still waiting (only the open's work is noted)
    t_sent = time.perf_counter()
    sent.set()
    assert _after(worker, 2) >= t_sent


def test_the_wait_is_bounded_and_absent_without_a_handover(worker):
    fut = worker.submit(Step("s", 0, (1,)), handover=threading.Event())  # never set: a lost transport
    t = time.perf_counter()
    fut.result(timeout=5)
    assert WAIT_S * 0.9 <= _after(worker, 2) - t < WAIT_S + 2.0
    fut = worker.submit(Step("s", 1, (1,)))  # in-process callers ask for none
    fut.result(timeout=5)
    t = time.perf_counter()
    assert _after(worker, 3) - t < WAIT_S / 2


def test_a_worker_told_not_to_wait_does_not(worker):
    worker.handover_wait_s = 0.0
    fut = worker.submit(Step("s", 0, (1,)), handover=threading.Event())
    fut.result(timeout=5)
    t = time.perf_counter()
    assert _after(worker, 2) - t < WAIT_S / 2


def test_the_setting_reaches_the_draft_worker(tiny_models):
    from specextend.config import EngineConfig
    from specextend.draft.jobs import HANDOVER_WAIT_S
    from specextend.draft.worker import DraftWorker

    draft = tiny_models("float32")[1].decoder
    assert EngineConfig().draft_handover is True
    for handover, wait in ((True, HANDOVER_WAIT_S), (False, 0.0)):
        w = DraftWorker(draft, handover=handover)
        assert w.handover_wait_s == wait
        w.shutdown()
