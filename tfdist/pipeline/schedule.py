"""Pipeline schedules: what each stage does, in which order.

An item is ("F", i) or ("B", i): the forward or the backward pass of
micro-batch i on one stage. A stage runs its items in its schedule's order;
between stages, F(s, i) needs F(s-1, i) and B(s, i) needs B(s+1, i).

- GPipe (Huang et al., 2019): every forward, then every backward. Each stage
  keeps all M micro-batches' activations until their backward.
- 1F1B (PipeDream-Flush, Narayanan et al., 2021): stage s runs S-1-s forwards
  first (the warm-up), then one forward and one backward in turn, then the
  remaining backwards. At most S-s micro-batches are between their forward
  and their backward on stage s, so activations alive are bounded by S, not M.

Both have the same bubble: (S-1)/(M+S-1) of each stage's time idle when every
item takes the same time.
"""

from __future__ import annotations

from tfdist.config import PIPELINE_SCHEDULES as SCHEDULES


def schedule(m: int, kind: str, stages: int = 2) -> list:
    """Each stage's items in order: [[("F"|"B", micro-batch), ...] per stage]."""
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline schedule {kind!r} is not known; valid: {', '.join(SCHEDULES)}")
    if kind == "gpipe":
        return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)]
                for _ in range(stages)]
    out = []
    for s in range(stages):
        warm = min(m, stages - 1 - s)
        order, f, b = [("F", i) for i in range(warm)], warm, 0
        while b < m:
            if f < m:
                order.append(("F", f))
                f += 1
            order.append(("B", b))
            b += 1
        out.append(order)
    return out


def build_order(plan: list) -> list:
    """All items as (stage, kind, micro-batch), in an order that respects both
    each stage's own order and the data between stages (what a single traced
    program must create its ops in): round robin over the stages, each taking
    its next item when that item's input from the neighbouring stage exists."""
    stages = len(plan)
    position = [0] * stages
    done = set()
    order = []

    def ready(s, kind, i):
        if kind == "F":
            return s == 0 or (s - 1, "F", i) in done
        return (s, "F", i) in done and (s == stages - 1 or (s + 1, "B", i) in done)

    while any(position[s] < len(plan[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] >= len(plan[s]):
                continue
            kind, i = plan[s][position[s]]
            if ready(s, kind, i):
                order.append((s, kind, i))
                done.add((s, kind, i))
                position[s] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"pipeline schedule deadlocks: {plan}")
    return order


def peak_in_flight(plan: list) -> list:
    """Per stage, the most micro-batches between their forward and backward
    (whose activations that stage holds at once) when it runs its items in order."""
    peaks = []
    for items in plan:
        alive = peak = 0
        for kind, _ in items:
            alive += 1 if kind == "F" else -1
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def bubble(stages: int, m: int) -> float:
    """The ideal idle fraction (S-1)/(M+S-1) of GPipe and 1F1B."""
    return (stages - 1) / (m + stages - 1)
