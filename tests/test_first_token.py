"""The first token leaves as soon as the target's prefill gives it: it needs nothing from the draft,
whose open (its own prefill, on its own device or process) may take longer."""

import threading

from specextend.config import EngineConfig, SamplingParams, TreeConfig
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine


class SlowOpen(DraftWorker):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.release, self.opened = threading.Event(), threading.Event()

    def open(self, session_id, prompt_ids, params):
        self.release.wait(10)
        super().open(session_id, prompt_ids, params)
        self.opened.set()


def test_the_first_token_does_not_wait_for_the_drafts_open(tiny_models):
    target, draft = tiny_models("float64")
    prompt, params = [(7 * i + 3) % 200 for i in range(40)], SamplingParams(12, ignore_eos=True)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target).generate(prompt, params)
    worker = SlowOpen(draft.decoder)
    engine = Engine(EngineConfig(mode="sd", tree=TreeConfig(8, 4, 3), tree_policy="fixed"), target, worker)
    events = engine.stream(prompt, params)
    first = next(events)
    assert first.token_ids == ref[:1] and not worker.opened.is_set()  # out before the draft's open ended
    worker.release.set()
    rest = [t for ev in events for t in ev.token_ids]
    assert first.token_ids + rest == ref and first.stats.num_steps > 0 and not first.stats.fallback
    one = Engine(EngineConfig(mode="sd", tree=TreeConfig(8, 4, 3)), target, worker)
    assert one.generate(prompt, SamplingParams(1, ignore_eos=True))[0] == ref[:1]  # done before any step
    worker.shutdown()
