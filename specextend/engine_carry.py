"""What an engine's sessions hand on to the next (docs/architecture.md, "Adaptive speculation" and
"Pool snapshots"): the costs the last session that measured them left (controller.Costs), its
context lookup's gate, the choice between walking snapshots and asking, and whether the first tree
after start-up, whose wait carries one-off costs, is still to come. A mixin of engine.Engine."""

from __future__ import annotations

from typing import Optional

from specextend.controller import TreeController
from specextend.costs import Costs
from specextend.lookup import RequestLookup
from specextend.lookup_gate import LookupGate
from specextend.snapshot import SnapshotChoice


class EngineCarry:
    carry_costs = True  # a session starts from the last finished session's measurements (controller.Costs)

    def _start_carrying(self, draft_snapshots: str) -> None:
        self._costs: Optional[Costs] = None  # the costs the last session that measured them left
        self._gate: Optional[LookupGate] = None  # ... and its context lookup's gate (lookup_gate.LookupGate)
        self._first_tree = True  # the first tree after start-up: its wait carries one-off costs, not recorded
        self.snapshots = SnapshotChoice(draft_snapshots)  # per request: walk snapshots or ask ("Pool snapshots")

    def forget_text(self) -> None:
        """Forgets what earlier texts taught (the carried lookup gate, snapshots held), not the costs."""
        self._gate = None
        self.snapshots = SnapshotChoice(self.config.draft_snapshots)

    def forget_costs(self) -> None:
        """Forgets the costs earlier sessions measured: the next session measures its own, as an
        app's first request after its warm-up does."""
        self._costs = None

    def _prime(self, ctl: TreeController, use_draft: bool) -> None:
        """A speculative session's controller starts from the costs carried, where there are some: no
        warm-up steps, they were measured in this engine's earlier sessions."""
        if use_draft and self.carry_costs and self._costs is not None:
            ctl.start_from(self._costs)

    def _carried_gate(self) -> Optional[LookupGate]:
        return self._gate.carried() if self.carry_costs and self._gate else None

    def _hand_on(self, ctl: TreeController, lookup: Optional[RequestLookup], use_draft: bool) -> None:
        """A finished session's costs and gate, for the next request."""
        self._costs = (ctl.costs() if use_draft and self.carry_costs else None) or self._costs
        self._gate = lookup.gate if lookup is not None and self.carry_costs else self._gate
