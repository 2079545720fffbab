"""Forward durations for the adaptive policy (specextend/timing.py): on a GPU the device's time
between CUDA events around a forward, read when the step is recorded; on the CPU the host's."""

import pytest
import torch

from specextend.config import TreeConfig
from specextend.controller import TreeController
from specextend.ladder import ladder


class _Event:
    """A CUDA event's timing interface, on the host clock of a test."""

    def __init__(self, at):
        self.at, self.synced = at, False

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event's
        return 1e3 * (end.at - self.at)


def test_device_spans_are_read_when_the_step_ends():
    """On a GPU a forward's host time is its launch; its Span holds events around it, read when the
    step is recorded (after the step read the logits), and it is the device's time that the cost
    line and the plain step's forward learn."""
    from specextend.timing import Span

    ctl = TreeController(ladder(TreeConfig(8, 3, 2)))
    end = _Event(0.007)
    ctl.record_forward(1, Span(0.0003, (_Event(0.0), end)))
    assert not end.synced and not ctl.forward.known  # not read yet
    ctl.record_plain(step_s=0.0075)
    assert end.synced
    assert ctl.plain_forward == pytest.approx(0.007)
    assert ctl.extra_plain == pytest.approx(0.0005)
    assert ctl.forward(1) == pytest.approx(0.007)
    ctl.record_forward(2048, 0.05)  # plain seconds (a CPU forward) are taken as they are
    ctl.choose()
    assert ctl.forward.known and not ctl._pending


def test_metered_times_forwards_on_the_host_off_cuda():
    """`metered` gives each forward a Span: on the CPU its host time, with no events."""
    from specextend.session_calls import Load, metered
    from specextend.timing import Span

    got = []

    def forwards():
        yield type("Call", (), {"ids": torch.zeros(3, dtype=torch.long)})()
        return "done"

    co = metered(forwards(), Load(), lambda rows, span: got.append((rows, span)))
    next(co)
    with pytest.raises(StopIteration):
        co.send("logits")
    (rows, span), = got
    assert rows == 3 and isinstance(span, Span) and span.events is None and span.seconds() >= 0
