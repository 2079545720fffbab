"""Trees with no wait for the draft: the target's local copy of the draft's pool (docs/architecture.md,
"Pool snapshots").

With an overlapping draft on its own GPU, a tree asked for at a step costs the target a round trip
to the draft (transport, the draft's thread, its answer): about 2 ms on two H200s against a 3 ms
verification (2026-11-27). Instead, every verdict goes to the draft at once (a ready-only step call
for `SNAPSHOT_NODES` nodes, in flight while the target goes on), and its answer is a *snapshot*: the
best nodes of the draft's pool re-rooted at that verdict, best first (by path score: a topological
order in which every prefix is the best tree of its size, and the nodes below any node, in index
order, are again best first). The target keeps the latest snapshot it has received and, at a tree
step, walks it from its root along the tokens committed since (the verdicts the draft has not
answered yet) and takes the first nodes below where the walk ends: a tree at once, or none (a plain
or lookup step, with no wait either). Lossless as any tree: the target verifies what it proposes.

`subtree_at` is the pure function (twin: `subtree_at_scan`); `DraftFeed` keeps one request's
snapshot, its call in flight and the tokens not yet sent; `SnapshotChoice` decides, request by
request, whether snapshots are used at all (`draft_snapshots=auto`).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Generator, Optional, Sequence

from specextend.draft.base import DraftError, DraftTree, TreeBound
from specextend.retrieval import launch_scoring
from specextend.session_calls import DraftCall

SNAPSHOT_NODES = 128  # pool nodes asked for per verdict (best first): deep enough to hold the
# subtree below the next verdict's bonus token, which a tree is cut from
SNAPSHOT_BOUND = TreeBound(nodes=SNAPSHOT_NODES, ready_only=True)  # every call's bound: at once, that many
HOLD_SHARE = 0.5  # auto: snapshots stay on while at least this share of a request's trees came from them
MIN_TREES = 8  # auto: a request with fewer tree steps decides nothing
PROBE_EVERY = 8  # auto: with snapshots off, every PROBE_EVERY-th request tries them again
GIVE_UP_TREES, GIVE_UP_SHARE = 16, 0.25  # auto: a request whose first 16+ tree steps took under a
# quarter of their trees from snapshots asks early for the rest


class SnapshotChoice:
    """`draft_snapshots` for each new request (docs/architecture.md, "Pool snapshots"): "on" and
    "off" as set; "auto" uses snapshots while they hold the trees. They pay where the draft's pool
    runs a verdict ahead of the target (a small draft beside a large target: two H200s, 2026-11-28,
    the 8B geometry with a 68M draft, 2.73-2.91x served `ar` against 2.53-2.55x with early asks)
    and cost where it does not (a 1B-geometry draft at 32K: 10 of 72 trees from snapshots, 0.94x
    early asks' speed). So a request that used them and made at least `MIN_TREES` tree steps,
    fewer than `HOLD_SHARE` of them from a snapshot, turns them off for the requests after it (one
    that met enough turns them back on), and with them off every `PROBE_EVERY`-th request tries
    them again. Starts on. Decided when a request starts, carried like the policy's costs; within
    a request the only change is giving snapshots up where their failure is clear (`gives_up`)."""

    def __init__(self, setting: str = "auto", probe_every: int = PROBE_EVERY) -> None:
        if setting not in ("auto", "on", "off"):
            raise ValueError(f"draft_snapshots must be auto, on or off, not {setting!r}")
        self.setting, self.probe_every = setting, probe_every
        self.holds = True  # auto: the last deciding request's verdict
        self._skipped = 0  # auto: requests without snapshots since they were last tried

    def use(self) -> bool:
        """Whether the request starting now uses snapshots."""
        if self.setting != "auto":
            return self.setting == "on"
        if self.holds:
            return True
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return True
        return False

    def gives_up(self, stats) -> bool:
        """auto: whether the request under way (its RequestStats) stops walking snapshots now, their
        failure being clear (`GIVE_UP_SHARE` of `GIVE_UP_TREES` or more tree steps), and asks early
        for the rest of it (DraftFeed.handover)."""
        trees = _tree_steps(stats)
        return self.setting == "auto" and trees >= GIVE_UP_TREES and stats.snapshot_trees < GIVE_UP_SHARE * trees

    def record(self, stats) -> None:
        """A request that used snapshots has ended (its RequestStats: tree steps, verified or
        unready, and `snapshot_trees` of them walked from a snapshot)."""
        trees = _tree_steps(stats)
        if self.setting == "auto" and trees >= MIN_TREES:
            self.holds = stats.snapshot_trees >= HOLD_SHARE * trees
            self._skipped = 0


def _tree_steps(stats) -> int:
    """A request's tree steps so far: verified, or unready (no tree at hand)."""
    return stats.num_steps + stats.unready_steps


@dataclass(frozen=True)
class Snapshot:
    """The draft's best pool nodes below the token that ended the `length`-th committed token (the
    root: the last token the call carried), best first."""

    tokens: tuple[int, ...]  # [M]
    parents: tuple[int, ...]  # [M] parent index, -1 = the root
    length: int  # committed tokens (the prompt's included) up to and including the root


def subtree_at(tokens: Sequence[int], parents: Sequence[int], path: Sequence[int],
               n: int) -> Optional[tuple[list[int], list[int]]]:
    """The tree below the node reached from the root along `path` (tokens after the root): the
    first `n` of its descendants in index order (best first, when the snapshot is), re-indexed as a
    tree rooted there. None if `path` leaves the snapshot, or nothing lies below its end."""
    node = -1
    kids: dict[tuple[int, int], int] = {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        kids.setdefault((p, t), i)  # the first such child (a best-first snapshot has no duplicates)
    for tok in path:
        node = kids.get((node, int(tok)), -2)
        if node == -2:
            return None
    inside = {node: -1}  # snapshot index -> new index (the new root -> -1)
    out_t: list[int] = []
    out_p: list[int] = []
    for i in range(node + 1, len(tokens)):  # descendants come after their ancestors
        if len(out_t) >= n:
            break
        p = parents[i]
        if p in inside:
            inside[i] = len(out_t)
            out_t.append(tokens[i])
            out_p.append(inside[p])
    return (out_t, out_p) if out_t else None


def subtree_at_scan(tokens: Sequence[int], parents: Sequence[int], path: Sequence[int],
                    n: int) -> Optional[tuple[list[int], list[int]]]:
    """subtree_at's twin: each node's ancestor chain walked to the root, no index."""
    def chain(i):  # tokens from the root's child down to node i
        out = []
        while i >= 0:
            out.append(tokens[i])
            i = parents[i]
        return out[::-1]

    want = list(path)
    ends = [i for i in range(len(tokens)) if chain(i) == want]
    node = -1 if not want else (min(ends) if ends else None)
    if node is None:
        return None

    def below(i):
        while i >= 0:
            i = parents[i]
            if i == node:
                return True
        return node == -1

    chosen = [i for i in range(len(tokens)) if i != node and below(i)][:n]
    pos = {node: -1, **{c: k for k, c in enumerate(chosen)}}
    return ([tokens[c] for c in chosen], [pos[parents[c]] for c in chosen]) if chosen else None


class DraftFeed:
    """One request's snapshots: `commit` the tokens each step commits, `send` them (with the
    newest retrieval selection) whenever no call is in flight, `tree` a step's tree from the latest
    snapshot. Calls stay one at a time and in order: tokens committed while one is in flight go
    with the next (the draft walks its pool along all of them). `send_fn(n, tokens, retrieval)` starts
    call number n (0, 1, ...) and returns its Future (a DraftTree); a call that failed with a
    DraftError leaves it in `error` and the feed sends nothing more (the request decodes plainly)."""

    def __init__(self, send_fn: Callable[[int, list[int], object], Future], length: int) -> None:
        self.send_fn = send_fn
        self.calls = 0  # calls started
        self.error: Optional[DraftError] = None
        self.length = length  # committed tokens so far, the prompt's included
        self.unsent: list[int] = []  # committed, not yet sent to the draft
        self.retrieval = None  # the newest selection not yet sent
        self.snapshot: Optional[Snapshot] = None
        self.inflight: Optional[tuple[Future, int]] = None  # (call, length its answer is rooted at)
        self.last: Optional[Future] = None  # the latest call started
        self._log: list[int] = []  # every token committed since the feed began
        self._base = length

    def commit(self, tokens: Sequence[int], retrieval=None) -> None:
        self.unsent += [int(t) for t in tokens]
        self._log += [int(t) for t in tokens]
        self.length += len(tokens)
        if retrieval is not None:
            self.retrieval = retrieval

    def poll(self) -> bool:
        """Takes the answer of the call in flight if it came (its DraftError into `error`); True if
        a call is still in flight."""
        if self.inflight is None:
            return False
        fut, length = self.inflight
        if not fut.done():
            return True
        self.inflight = None
        try:
            tree = fut.result()
        except DraftError as e:
            self.error, self.snapshot = e, None
            return False
        self.snapshot = Snapshot(tuple(tree.tokens), tuple(tree.parents), length)
        return False

    def send(self) -> Optional[Future]:
        """Starts a call with the unsent tokens if none is in flight; the call, or None."""
        if self.poll() or not self.unsent or self.error is not None:
            return None
        fut = self.send_fn(self.calls, self.unsent, self.retrieval)
        self.calls, self.last = self.calls + 1, fut
        self.inflight = (fut, self.length)
        self.unsent, self.retrieval = [], None
        return fut

    def take(self, retrieval) -> None:
        """A selection the engine holds, to go with the next tokens sent (a run's: their calls may
        start on another thread, so its scoring is launched now). -> None, the engine's new value."""
        launch_scoring(retrieval)
        self.commit([], retrieval)

    def push(self, tokens: Sequence[int], retrieval=None, send: bool = True) -> None:
        """`commit`, then `send` (unless `send` is False: the draft has not joined yet)."""
        self.commit(tokens, retrieval)
        if send:
            self.send()

    def tree_co(self, step: int, n: int, stats) -> Generator[DraftCall, object, DraftTree]:
        """A tree step's tree (`step` numbers it): the latest snapshot walked here, with no call;
        where that gives less than half of `n` nodes and the answer for this very position is in
        flight, that answer, waited for (a DraftCall: its DraftError is thrown into the session).
        An empty tree: none (the step decodes plainly). Counts `stats.snapshot_trees` and
        `stats.asked_steps` (the waited ones)."""
        got = self.tree(n)
        if (got is None or 2 * len(got[0]) < n) and self.current() is not None:
            yield DraftCall(future=self.current())
            got = self.tree(n) or got
            stats.asked_steps += 1
        else:
            stats.snapshot_trees += got is not None
        return DraftTree(step=step, tokens=tuple(got[0]) if got else (), parents=tuple(got[1]) if got else (),
                         ready=got is not None)

    def tree(self, n: int) -> Optional[tuple[list[int], list[int]]]:
        """The best `n`-node tree at the current position from the latest snapshot (None: none)."""
        self.poll()
        s = self.snapshot
        if s is None or self.error is not None:
            return None
        return subtree_at(s.tokens, s.parents, self._log[s.length - self._base:], n)

    def handover(self) -> tuple[list[int], object, int, Optional[Future]]:
        """Snapshots given up mid-request: (the committed tokens not yet sent, the newest selection
        not yet sent, the step number of the next call, and where every committed token was sent,
        the last call, whose answer is the tree for here: an early ask's). The feed is then dropped;
        its call in flight, if any, is the session lane's (start_ask): the calls after it wait for it."""
        out = (self.unsent, self.retrieval, self.calls, None if self.unsent else self.last)
        self.unsent, self.retrieval = [], None
        return out

    def current(self) -> Optional[Future]:
        """The call in flight if its answer will be rooted at the current position (nothing
        committed since it was sent): a step whose snapshot is too thin may wait for it."""
        if self.inflight is None or self.inflight[1] != self.length:
            return None
        return self.inflight[0]

    def pending(self) -> Optional[Future]:
        """The call in flight (a session's close must come after it)."""
        return None if self.inflight is None else self.inflight[0]
