"""The per-step round trip between target and draft (docs/architecture.md, "Wire protocol"),
measured with a draft that does no work: a real gRPC draft server on 127.0.0.1 with the product's
per-replica token, around a null DraftBackend that answers a fixed 16-node tree at once, driven
through the product's client exactly as the engine calls it (`GrpcDraftBackend.step(session,
step, accepted, retrieval, bound)`, one call at a time, from the caller's thread).

  python benchmarks/rpc_roundtrip.py --steps 5000 --rounds 5

Each step sends 5 accepted tokens, 32 retrieval chunk ids and a tree bound and gets a 16-node tree
back. The paths are interleaved in rounds (a loaded machine slows them alike): `unary` (a Step
call per step), `stream` (StepStream, step_transport=grpc), `zmq` (the ZeroMQ step channel, the
client's default), `direct` (the null draft called in place). `grpc-echo` and `tcp-echo` are
floors, bare echoes of bytes of the same sizes in this process; `zmq-echo` a bare DEALER/ROUTER
echo of the same bytes, answered in the draft server's process (a thread beside the server).
With `--after-ms X`, two more servers over null drafts whose thread works X ms of Python after
each answer, as a real draft's does (the K/V moves of a ready step, the next background launch):
`zmq-busy` hands each answer over to the channel's thread first (the product), `zmq-busy-late`
does not (its answer competes with that work for the GIL); their steps come 2X apart (untimed).
Prints a table (median, p90, p99, mean per step in us, and the payload sizes) and writes
JSON under results/rpc/.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import queue
import socket
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import grpc
import zmq

from specextend.bench.record import commit
from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftBackend, DraftSessionParams, DraftTree, Retrieval, TreeBound
from specextend.draft.jobs import SerialDraft, Step
from specextend.rpc import DraftServerThread, GrpcDraftBackend
from specextend.rpc.auth import new_token
from specextend.rpc.convert import step_to_proto, tree_to_proto

OUT = Path(__file__).parent / "results" / "rpc"
ACCEPTED = (101, 202, 303, 404, 505)  # an accepted path of 4 + the bonus token
CHUNK_IDS = tuple(range(0, 64, 2))  # 32 retrieval chunk ids
BOUND = TreeBound(nodes=16, depth=6)
PARENTS = (-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 5, 5, 6, 8, 11)  # a 16-node tree, best first
TREE_TOKENS = tuple(1000 + 37 * i for i in range(len(PARENTS)))
PARAMS = DraftSessionParams(TreeConfig(nodes=16, depth=6, topk=4),
                            RetrievalConfig(enabled=True, chunk_size=32, top_k=32, every=1), max_new_tokens=4096)

# the client's constructor arguments of each path measured (GrpcDraftBackend)
PATHS = {"unary": {"transport": "grpc", "stream": False}, "stream": {"transport": "grpc", "stream": True},
         "zmq": {"transport": "zmq"}}


class NullDraft(DraftBackend):
    """Answers every step with the same 16-node tree, at once: no draft compute at all."""

    def open(self, session_id, prompt_ids, params):
        pass

    def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None) -> DraftTree:
        return DraftTree(step=step, tokens=TREE_TOKENS, parents=PARENTS, draft_cache_tokens=2048)

    def close(self, session_id):
        pass


def percentile(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def time_steps(step: Callable[[int], DraftTree], first: int, n: int, gap_s: float = 0.0) -> list[float]:
    """Per-step wall time in us of steps first .. first+n-1 (`gap_s` untimed before each, as the
    target's verification between two steps)."""
    out = []
    for k in range(first, first + n):
        if gap_s:
            time.sleep(gap_s)
        t = time.perf_counter_ns()
        tree = step(k)
        out.append((time.perf_counter_ns() - t) / 1e3)
        assert tree.step == k and tree.tokens == TREE_TOKENS
    return out


@contextmanager
def zmq_echo() -> Iterator[str]:
    """A bare ROUTER on a thread answering every [id, bytes] with [id, a tree's worth of bytes]:
    the floor of the step channel. Yields its endpoint."""
    ctx = zmq.Context()
    reply = b"t" * payload_bytes()["draft_tree"]
    router, stop = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PAIR)
    router.bind("tcp://127.0.0.1:*")
    stop.bind("inproc://echo-stop")

    def run():
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if stop in events:
                return
            identity, _ = router.recv_multipart()
            router.send_multipart((identity, reply))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield router.getsockopt_string(zmq.LAST_ENDPOINT)
    finally:
        with ctx.socket(zmq.PAIR) as signal:
            signal.connect("inproc://echo-stop")
            signal.send(b"")
            thread.join()
        router.close(0)
        stop.close(0)
        ctx.term()


class BusyAfter(SerialDraft):
    """The null draft whose thread then works `after_s` of Python after each step's answer, as a
    real draft's thread does (a ready step's K/V moves, the next background launch): the answer
    competes with it for the GIL unless the worker hands it over first (`handover`)."""

    def __init__(self, after_s: float, handover: bool) -> None:
        self.after_s = after_s
        if not handover:
            self.handover_wait_s = 0.0
        super().__init__(NullDraft())

    def _run_job(self, job, fut) -> None:
        super()._run_job(job, fut)
        if isinstance(job, Step):
            end = time.perf_counter() + self.after_s
            while time.perf_counter() < end:  # Python, holding the GIL but for switch intervals
                sum(range(50))


@contextmanager
def servers(token: str, after_s: float) -> Iterator[tuple[str, ...]]:
    """The null draft behind the product's server, the bare ZeroMQ echo, and with `after_s` two more
    servers over BusyAfter workers (answers handed over, and not): their addresses."""
    with contextlib.ExitStack() as stack:
        out = [stack.enter_context(DraftServerThread(NullDraft(), "127.0.0.1", 0, model="null", token=token)).address,
               stack.enter_context(zmq_echo())]
        if after_s:
            for handover in (True, False):
                out.append(stack.enter_context(DraftServerThread(BusyAfter(after_s, handover), "127.0.0.1", 0,
                                                                 model="null", token=token)).address)
        yield tuple(out)


def serve(token: str, conn, switch_interval: Optional[float], after_s: float) -> None:
    """The draft process: `servers` until told to stop."""
    if switch_interval:
        sys.setswitchinterval(switch_interval)
    with servers(token, after_s) as addresses:
        conn.send(addresses)
        conn.recv()


@contextmanager
def draft_server(token: str, in_process: bool, switch_interval: Optional[float],
                 after_s: float = 0.0) -> Iterator[tuple[str, ...]]:
    """`servers`' addresses: in a process of their own (as the deployment runs the draft), or in
    this one."""
    if in_process:
        with servers(token, after_s) as addresses:
            yield addresses
        return
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(token, there, switch_interval, after_s), daemon=True)
    proc.start()
    try:
        yield here.recv()
    finally:
        here.send(None)
        proc.join(10)


def measure(steps: int, rounds: int, warmup: int, in_process: bool = False,
            switch_interval: Optional[float] = None, after_s: float = 0.0) -> dict[str, list[float]]:
    token = new_token()
    retrieval = Retrieval(CHUNK_IDS, PARAMS.retrieval.chunk_size)
    null = NullDraft()
    samples: dict[str, list[float]] = {"direct": []}  # the null backend called in place
    with draft_server(token, in_process, switch_interval, after_s) as (address, echo, *busy):
        clients = {name: GrpcDraftBackend(address, timeout_s=5.0, token=token, **kw)
                   for name, kw in PATHS.items()}
        for name, where in zip(("zmq-busy", "zmq-busy-late"), busy):  # handed over, and not
            clients[name] = GrpcDraftBackend(where, timeout_s=5.0, token=token, transport="zmq")
        next_step = {}
        for name, client in clients.items():
            client.open(name, list(range(1024)), PARAMS)
            samples[name] = []
            time_steps(lambda k: client.step(name, k, ACCEPTED, retrieval, BOUND), 0, warmup)
            next_step[name] = warmup
        per_round = steps // rounds
        for _ in range(rounds):
            for name, client in clients.items():
                gap = 2 * after_s if name.startswith("zmq-busy") else 0.0  # the worker's own work done
                samples[name] += time_steps(lambda k: client.step(name, k, ACCEPTED, retrieval, BOUND),
                                            next_step[name], per_round, gap)
                next_step[name] += per_round
            samples["direct"] += time_steps(lambda k: null.step("d", k, ACCEPTED, retrieval, BOUND), 0, per_round)
        assert clients["zmq"].step_endpoint and not clients["stream"].step_endpoint  # each took its path
        for name, client in clients.items():
            client.close(name)
            client.shutdown()
        samples["zmq-echo"] = zmq_echo_floor(echo, per_round * rounds, warmup)
    return samples


def zmq_echo_floor(endpoint: str, steps: int, warmup: int) -> list[float]:
    """A DEALER sending a StepRequest's worth of bytes to the bare echo and waiting for the reply."""
    request = b"r" * payload_bytes()["step_request"]
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)

        def step(k):
            sock.send(request)
            sock.recv()

        for k in range(warmup):
            step(k)
        out = []
        for _ in range(steps):
            t = time.perf_counter_ns()
            step(0)
            out.append((time.perf_counter_ns() - t) / 1e3)
    return out


def floors(steps: int) -> dict[str, list[float]]:
    """What any design on this host pays, measured in this process with the same payload sizes: a
    bare gRPC bidirectional echo of bytes (no protobuf, no draft worker) and a bare TCP echo."""
    request, reply = b"r" * payload_bytes()["step_request"], b"t" * payload_bytes()["draft_tree"]

    def echo(requests, context):
        for _ in requests:
            yield reply

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4), handlers=[grpc.method_handlers_generic_handler(
        "floor.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    requests: queue.SimpleQueue = queue.SimpleQueue()
    replies = channel.stream_stream("/floor.Echo/Echo")(iter(requests.get, None))

    def grpc_step(k):
        requests.put(request)
        next(replies)

    listener = socket.create_server(("127.0.0.1", 0))

    def tcp_echo():
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while conn.recv(4096):
            conn.sendall(reply)

    threading.Thread(target=tcp_echo, daemon=True).start()
    sock = socket.create_connection(listener.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def tcp_step(k):
        sock.sendall(request)
        sock.recv(4096)

    out = {}
    for name, step in (("grpc-echo", grpc_step), ("tcp-echo", tcp_step)):
        for k in range(300):
            step(k)
        out[name] = []
        for _ in range(steps):
            t = time.perf_counter_ns()
            step(0)
            out[name].append((time.perf_counter_ns() - t) / 1e3)
    requests.put(None)
    sock.close()
    listener.close()
    channel.close()
    server.stop(0).wait()
    return out


def summary(xs: list[float]) -> dict:
    return dict(n=len(xs), median_us=statistics.median(xs), p90_us=percentile(xs, 0.9),
                p99_us=percentile(xs, 0.99), mean_us=statistics.fmean(xs))


def payload_bytes() -> dict:
    retrieval = Retrieval(CHUNK_IDS, PARAMS.retrieval.chunk_size)
    request = step_to_proto("0123456789abcdef0123456789abcdef", 1000, ACCEPTED, retrieval, BOUND)
    tree = DraftTree(step=1000, tokens=TREE_TOKENS, parents=PARENTS, draft_cache_tokens=2048)
    return dict(step_request=request.ByteSize(), draft_tree=tree_to_proto(tree).ByteSize(),
                accepted_tokens=len(ACCEPTED), chunk_ids=len(CHUNK_IDS), tree_nodes=len(PARENTS))


def write_record(out: Path, fields: dict) -> dict:
    """`fields` with the run's commit, date, host and interpreter, as JSON at `out` (and returned)."""
    record = dict(commit=commit(), date=datetime.date.today().isoformat(), host=platform.node(),
                  python=sys.version.split()[0], command=" ".join(sys.argv), cpus=os.cpu_count(),
                  load_avg=os.getloadavg(), switch_interval_s=sys.getswitchinterval(), **fields)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return record


def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5000, help="timed steps per path")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds the steps are split into")
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--in-process", action="store_true", help="the server in this process (one GIL for both)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval in both processes (the draft worker sets 0.0002 with overlap)")
    ap.add_argument("--after-ms", type=float, default=0.0,
                    help="also serve null drafts whose thread works this long after each answer (paths "
                         "zmq-busy: the answer handed over first, zmq-busy-late: not; their steps come "
                         "twice that apart, untimed)")
    ap.add_argument("--out", type=Path, default=OUT / "rpc_roundtrip-cpu.json")
    args = ap.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    samples = measure(args.steps, args.rounds, args.warmup, args.in_process, args.switch_interval,
                      args.after_ms / 1e3)
    samples.update(floors(args.steps // args.rounds))
    results = {name: summary(xs) for name, xs in samples.items()}
    sizes = payload_bytes()
    print(f"{'path':<14} {'n':>6} {'median us':>10} {'p90 us':>8} {'p99 us':>8} {'mean us':>8}")
    for name, r in results.items():
        print(f"{name:<14} {r['n']:>6} {r['median_us']:>10.1f} {r['p90_us']:>8.1f} {r['p99_us']:>8.1f} "
              f"{r['mean_us']:>8.1f}")
    print(f"payload: StepRequest {sizes['step_request']} B ({len(ACCEPTED)} accepted tokens, "
          f"{len(CHUNK_IDS)} chunk ids), DraftTree {sizes['draft_tree']} B ({len(PARENTS)} nodes)")
    return write_record(args.out, dict(
        suite="rpc_roundtrip", cpu=platform.processor() or platform.machine(),
        server="in process" if args.in_process else "own process", payload=sizes, paths=results))


if __name__ == "__main__":
    main()
