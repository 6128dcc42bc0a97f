"""Pipeline schedules: what each device does, in which order.

The model is split into S x v stages over S devices (processes) per pipeline
replica: stage s on device s mod S, so each device runs v chunks of the model
(v = --pipeline_chunks, 1 unless interleaved). An item is (s, "F", i) or
(s, "B", i): the forward or the backward pass of micro-batch i on stage s. A
device runs its items in its schedule's order; between stages, F(s, i) needs
F(s-1, i) and B(s, i) needs B(s+1, i).

- GPipe (Huang et al., 2019): every forward, then every backward (with v
  chunks: each chunk's forwards in model order, then each chunk's backwards in
  reverse). Each stage keeps all M micro-batches' activations until their
  backward.
- 1F1B (PipeDream-Flush, Narayanan et al., 2021): device s runs S-1-s
  forwards first (the warm-up), then one forward and one backward in turn,
  then the remaining backwards. At most S-s micro-batches are between their
  forward and their backward on device s, so activations alive are bounded by
  S, not M.
- Interleaved 1F1B (v > 1; Narayanan et al., 2021, Megatron-LM's order): the
  micro-batches go in groups of S; a device runs a group's forwards on its
  first chunk, then on its second, ..., and its backwards the same way from
  its last chunk, after a warm-up of 2(S-1-s) + (v-1)S forwards. M must be a
  multiple of S.

With every item of a stage taking the same time, the ideal bubble, the share
of each device's time it waits, is (S-1)/(vM+S-1): v chunks make each
device's idle start and end v times shorter, at v times the boundary
transfers.
"""

from __future__ import annotations

from tfdist.config import PIPELINE_SCHEDULES as SCHEDULES


def schedule(m: int, kind: str, devices: int = 2, chunks: int = 1) -> list:
    """Each device's items in order: [[(stage, "F"|"B", micro-batch), ...]
    per device], device d running stages d, d + S, ... (S = `devices`)."""
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline schedule {kind!r} is not known; valid: {', '.join(SCHEDULES)}")
    if chunks < 1 or devices < 1:
        raise ValueError(f"pipeline schedule over {devices} device(s) x {chunks} chunk(s)")
    if kind == "gpipe":
        return [[(c * devices + d, "F", i) for c in range(chunks) for i in range(m)]
                + [(c * devices + d, "B", i) for c in reversed(range(chunks)) for i in range(m)]
                for d in range(devices)]
    if chunks == 1:
        return [_one_f_one_b(m, devices, d) for d in range(devices)]
    if m % devices:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({m}) in groups of the "
                         f"devices per pipeline ({devices})")
    return [_interleaved(m, devices, chunks, d) for d in range(devices)]


def _one_f_one_b(m: int, devices: int, d: int) -> list:
    warm = min(m, devices - 1 - d)
    order, f, b = [(d, "F", i) for i in range(warm)], warm, 0
    while b < m:
        if f < m:
            order.append((d, "F", f))
            f += 1
        order.append((d, "B", b))
        b += 1
    return order


def _interleaved(m: int, devices: int, chunks: int, d: int) -> list:
    total = m * chunks

    def item(k: int, kind: str) -> tuple:
        chunk = (k % (devices * chunks)) // devices
        if kind == "B":
            chunk = chunks - 1 - chunk
        return (chunk * devices + d, kind, (k // (devices * chunks)) * devices + k % devices)

    warm = min(total, 2 * (devices - 1 - d) + (chunks - 1) * devices)
    order = [item(k, "F") for k in range(warm)]
    for k in range(total - warm):
        order += [item(warm + k, "F"), item(k, "B")]
    return order + [item(k, "B") for k in range(total - warm, total)]


def build_order(plan: list) -> list:
    """All items as (stage, kind, micro-batch), in an order that respects both
    each device's own order and the data between stages (what a single traced
    program must create its ops in): round robin over the devices, each taking
    its next item when that item's input from the neighbouring stage exists."""
    last = max(s for items in plan for s, _, _ in items)
    position = [0] * len(plan)
    done = set()
    order = []
    while any(position[d] < len(plan[d]) for d in range(len(plan))):
        progressed = False
        for d, items in enumerate(plan):
            if position[d] >= len(items):
                continue
            if all(n in done for n in _inputs(*items[position[d]], last)):
                order.append(items[position[d]])
                done.add(items[position[d]])
                position[d] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"pipeline schedule deadlocks: {plan}")
    return order


def _inputs(s: int, kind: str, i: int, last: int) -> list:
    """The items whose outputs item (s, kind, i) takes: F(s, i) takes
    F(s-1, i); B(s, i) takes F(s, i) and B(s+1, i)."""
    if kind == "F":
        return [(s - 1, "F", i)] if s else []
    return [(s, "F", i)] + ([(s + 1, "B", i)] if s < last else [])


def peak_in_flight(plan: list) -> list:
    """Per device, the most (stage, micro-batch) pairs between their forward
    and backward (whose activations that device holds at once) when it runs
    its items in order."""
    peaks = []
    for items in plan:
        alive = peak = 0
        for _, kind, _ in items:
            alive += 1 if kind == "F" else -1
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def bubble(devices: int, m: int, chunks: int = 1) -> float:
    """The ideal idle fraction (S-1)/(vM+S-1) of each device."""
    return (devices - 1) / (chunks * m + devices - 1)


def simulated_bubble(plan: list, forward: float = 1.0, backward: float = 2.0) -> float:
    """The idle fraction of each device when every forward of a stage takes
    `forward` and every backward `backward` (transfers free): each device
    runs its items in order, each as soon as its inputs exist. Equals
    `bubble` for GPipe, 1F1B and interleaved 1F1B; what a measured timeline
    is held against."""
    last = max(s for items in plan for s, _, _ in items)
    chunks = (last + 1) // len(plan)
    ended, free, busy = {}, [0.0] * len(plan), 0.0
    for s, kind, i in build_order(plan):   # each device's items in its own order
        d = s % len(plan)
        took = (forward if kind == "F" else backward) / chunks
        ended[(s, kind, i)] = free[d] = max(
            [free[d]] + [ended[n] for n in _inputs(s, kind, i, last)]) + took
        busy += took
    return 1 - busy / (len(plan) * max(ended.values()))
