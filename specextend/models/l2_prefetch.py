"""L2 prefetch of the weights a decode-time forward reads next (docs/architecture.md, "Kernels").

A small forward's kernels each stream a few megabytes of weights and pay the DRAM latency and
ramp-up for them, so none reaches the copy bandwidth (the 0.5B draft's gate/up at 4 rows moves
17.4 MB at 1.2-1.45 TB/s however it is tiled). None of those weights depends on the forward's
activations: they can be in L2 before the kernel that reads them starts. So the full-step graphs
fork a side branch at the start of each body step (graph node) that asks the L2 for the weights
of the steps ahead, up to `lead` bytes past the step's own, and join it at the step's end. The
branch is one small kernel of bulk L2 prefetches (`cp.async.bulk.prefetch.L2`, sm_90) or of
per-line `prefetch.global.L2::evict_last` (older GPUs): no registers hold the data and no
thread waits for it, so it takes a few microseconds of a few multiprocessors.

A prefetch is a hint that changes no value: its twin is the forward without it, equal to the bit
(GPU test). On the CPU and in Triton's interpreter there is nothing to prefetch.

`usage` and `schedule` are pure (the order in which the body reads the weights, and which regions
each step asks for): tested on the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from specextend.attention.triton_prefix import triton_available

ALIGN = 16  # bulk prefetches take 16-byte aligned addresses and sizes
LINE = 128  # bytes a per-line prefetch asks for


def usage(weights, num_layers: int) -> list[tuple[int, torch.Tensor]]:
    """(body step, weight) in the order the full-step body reads them: step 0 is the embedding and
    layer 0's QKV, step i (1..n-1) layer i-1's o-projection and MLP then layer i's QKV, step n the
    last layer's o-projection and MLP then the LM head (full_graphs._body, graphs._segment)."""
    n = num_layers
    out = [(0, weights.layers[0].qkv)]
    for i in range(1, n + 1):
        lw = weights.layers[i - 1]
        out += [(i, lw.o), (i, lw.gate_up), (i, lw.down)]
        out.append((i, weights.layers[i].qkv if i < n else weights.lm_head))
    return out


def schedule(steps_of: list[int], sizes: list[int], num_steps: int, lead: int,
             max_region: int) -> list[list[int]]:
    """Which regions each body step asks the L2 for when it starts: region r (read by step
    steps_of[r], `sizes[r]` bytes, in reading order) is asked for by the first step whose own reads
    start less than `lead` bytes before r's, and never after its own step; regions over
    `max_region` bytes (an LM head that the L2 cannot hold) are never asked for. [step] -> [r]."""
    start, pos = [], 0
    for s in sizes:
        start.append(pos)
        pos += s
    step_start = [None] * num_steps  # bytes read before the step's first region
    for r, st in enumerate(steps_of):
        if step_start[st] is None:
            step_start[st] = start[r]
    for i in range(num_steps - 1, -1, -1):  # a step that reads nothing starts where the next does
        if step_start[i] is None:
            step_start[i] = step_start[i + 1] if i + 1 < num_steps else pos
    out: list[list[int]] = [[] for _ in range(num_steps)]
    for r, st in enumerate(steps_of):
        if sizes[r] > max_region or sizes[r] <= 0:
            continue
        first = next(i for i in range(num_steps) if step_start[i] + lead >= start[r] or i == st)
        out[min(first, st)].append(r)
    return out


def supported(device: torch.device) -> bool:
    return device.type == "cuda" and triton_available()


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _prefetch_kernel(table, R: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BULK: tl.constexpr):
        """Asks the L2 for R regions (table: [R, 2] int64 address, bytes; both multiples of 16),
        CHUNK bytes a lane, lanes of every program striding over the chunks."""
        lanes = tl.num_programs(0) * BLOCK
        lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        for r in tl.static_range(R):
            base = tl.load(table + 2 * r)
            nbytes = tl.load(table + 2 * r + 1)
            n = (nbytes + CHUNK - 1) // CHUNK
            for c0 in range(0, n, lanes):
                off = (c0 + lane).to(tl.int64) * CHUNK  # [BLOCK]
                if BULK:
                    on = (off < nbytes).to(tl.int32)
                    size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)
                    tl.inline_asm_elementwise(
                        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; "
                        "mov.u32 $0, 0; }",
                        "=r,l,r,r", [base + off, on, size], dtype=tl.int32, is_pure=False, pack=1)
                else:
                    for j in tl.static_range(CHUNK // 128):
                        o = off + j * 128
                        on = (o < nbytes).to(tl.int32)
                        tl.inline_asm_elementwise(
                            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; "
                            "mov.u32 $0, 0; }",
                            "=r,l,r", [base + o, on], dtype=tl.int32, is_pure=False, pack=1)


class L2Prefetch:
    """The prefetch branch of one model's full-step body: `fork(step)` before a step's kernels,
    `join()` after them (in a CUDA-graph capture the branch becomes a parallel node)."""

    def __init__(self, decoder, lead: int, programs: int = 16, bulk: Optional[bool] = None,
                 max_region: int = 64 << 20, join_each: bool = True, priority: int = -1):
        dev = decoder.device
        if not supported(dev):
            raise ValueError("L2 prefetch runs on CUDA with Triton")
        self.lead = lead
        self.join_each = join_each  # join after every step (else once, after the last step of a graph)
        self.bulk = torch.cuda.get_device_capability(dev)[0] >= 9 if bulk is None else bulk
        self.chunk = 16384 if self.bulk else 1024
        self.block = 128
        self.programs = programs
        n = decoder.args.num_layers
        regions = usage(decoder.w, n)
        spans = []
        for _, t in regions:  # 16-byte aligned inside the tensor
            a = t.data_ptr()
            lo = -(-a // ALIGN) * ALIGN
            hi = (a + t.numel() * t.element_size()) // ALIGN * ALIGN
            spans.append((lo, max(0, hi - lo)))
        self.plan = schedule([s for s, _ in regions], [b for _, b in spans], n + 1, lead, max_region)
        self.regions = max(1, max(len(x) for x in self.plan))
        table = torch.zeros(n + 1, self.regions, 2, dtype=torch.int64)  # [steps, R, (address, bytes)]
        for i, rs in enumerate(self.plan):
            for j, r in enumerate(rs):
                table[i, j, 0], table[i, j, 1] = spans[r]
        self.table = table.to(dev)
        self.bytes = [sum(spans[r][1] for r in rs) for rs in self.plan]
        self.weights = [t for _, t in regions]  # keep the tensors (and their addresses) alive
        self.side = torch.cuda.Stream(dev, priority=priority)

    def fork(self, step: int) -> bool:
        """Launches step's prefetches on the side stream after the work queued so far; False: none."""
        if not self.plan[step]:
            return False
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            _prefetch_kernel[(self.programs,)](self.table[step], R=self.regions, CHUNK=self.chunk,
                                               BLOCK=self.block, BULK=self.bulk, num_warps=4)
        return True

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.side)
