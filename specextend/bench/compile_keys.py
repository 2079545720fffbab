"""The Triton specializations a run meets, counted on any machine (docs/architecture.md, "Execution
plans"): each launch of a recorded kernel files its compile key, the constexpr values, the tensor
dtypes, the launch options, and for every other integer argument the 16-divisibility Triton
specializes it on (not for those the kernel names in `do_not_specialize`). On a GPU each new key is
a compile (~0.8 s on an H200 host); under Triton's CPU interpreter the same launches are counted
without compiling. `dry=True` records and skips the launch, zeroing its outputs: for counting the
keys of a large geometry on the CPU, where the kernels' results do not matter."""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

_LOCK = threading.RLock()  # the interpreter is not thread-safe (the draft's overlap thread launches too)
OUTPUTS = ("out_ptr", "lse_ptr", "q_ptr", "k_ptr", "v_ptr", "kpre_ptr")  # what a dry launch zeroes


def unspecialized(kernel) -> set[str]:
    """The integer arguments Triton does not specialize `kernel` on (its `do_not_specialize`, by name
    or position; a JITFunction's attribute, or the interpreter's jit keywords)."""
    jit_kw = getattr(kernel, "kwargs", None) or {}
    names = getattr(kernel, "do_not_specialize", None) or jit_kw.get("do_not_specialize", ()) or ()
    arg_names = getattr(kernel, "arg_names", None) or list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
    return {arg_names[x] if isinstance(x, int) else x for x in names}


class Recorder:
    """Stands in for a Triton kernel (`kernel[grid](...)`): records each launch's compile key, then
    launches it (or, dry, zeroes its output tensors)."""

    def __init__(self, kernel, dry: bool = False):
        self.kernel, self.dry, self.keys = kernel, dry, set()
        self.fn = getattr(kernel, "fn", kernel)
        self.params = inspect.signature(self.fn).parameters
        self.fixed = unspecialized(kernel)

    def _bound(self, args, kwargs) -> dict:
        own = {k: v for k, v in kwargs.items() if k in self.params}
        return inspect.signature(self.fn).bind_partial(*args, **own).arguments

    def key(self, args, kwargs) -> tuple:
        key = [tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.params))]  # num_warps, ...
        for name, value in self._bound(args, kwargs).items():
            if "constexpr" in str(self.params[name].annotation):
                key.append((name, value))
            elif isinstance(value, torch.Tensor):
                key.append((name, value.dtype))
            elif isinstance(value, int) and name not in self.fixed:
                key.append((name, value % 16 == 0, value == 1))
        return tuple(key)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _LOCK:
                self.keys.add(self.key(args, kwargs))
                if not self.dry:
                    return self.kernel[grid](*args, **kwargs)
                for name, value in self._bound(args, kwargs).items():
                    if name in OUTPUTS and isinstance(value, torch.Tensor):
                        value.zero_()
        return launch


@contextmanager
def recording(kernels: list[tuple[object, str]], dry: tuple[str, ...] = ()) -> Iterator[dict[str, Recorder]]:
    """Replaces each (module, name) kernel with a Recorder for the block (`dry`: those names
    recorded and not run); yields {name: Recorder}."""
    saved = [(m, n, getattr(m, n)) for m, n in kernels]
    recorders = {n: Recorder(k, dry=n in dry) for m, n, k in saved}
    for m, n, _ in saved:
        setattr(m, n, recorders[n])
    try:
        yield recorders
    finally:
        for m, n, k in saved:
            setattr(m, n, k)
