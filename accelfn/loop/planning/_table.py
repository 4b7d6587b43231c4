"""``str(plan)``: the plan as a readable table (bytes as MiB/GiB, per rank and for the job)."""

from __future__ import annotations

from typing import Any

_SHOWN_EPOCHS = 4


def size(n: int | None) -> str:
    """Bytes as B, KiB, MiB or GiB."""
    if n is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _span(values: tuple[int | None, ...]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "?"
    low, high = min(known), max(known)
    return str(low) if low == high else f"{low}..{high}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]


def render(plan: Any) -> str:
    """The plan's counts, memory, collectives and problems as text."""
    lines = [f"plan: {plan.world_size} process{'es' if plan.world_size > 1 else ''}, {plan.backend} backend, "
             f"{plan.precision}; {plan.total_updates if plan.total_updates is not None else '?'} optimizer updates"
             + (f", scheduler at step {plan.scheduler_steps} at the end" if plan.scheduler_steps is not None else "")]
    if plan.epochs:
        shown = plan.epochs[:_SHOWN_EPOCHS]
        rows = [["per rank", *(f"epoch {e.epoch}" if e.num_epochs == 1 else f"epochs {e.epoch}-{e.epoch + e.num_epochs - 1}"
                                for e in shown)]]
        rows.append(["updates", *(_span(e.updates) for e in shown)])
        rows.append(["micro-batches", *(_span(e.micro_batches) for e in shown)])
        rows.append(["samples read", *(_span(e.samples) for e in shown)])
        rows.append(["of them padded", *(_span(e.padded) for e in shown)])
        rows.append(["dropped (job)", *("?" if e.dropped is None else str(e.dropped) for e in shown)])
        lines += ["", "counts", *_table(rows)]
        if len(plan.epochs) > _SHOWN_EPOCHS:
            lines.append(f"  ... {len(plan.epochs) - _SHOWN_EPOCHS} more epochs like these")
    if plan.memory:
        worst = max(plan.memory, key=lambda m: m.peak)  # the rank holding the most
        job = plan.memory

        def row(label: str, attr: str) -> list[str]:
            return [label, size(getattr(worst, attr)), size(sum(getattr(m, attr) or 0 for m in job))]

        rows = [["memory", "per rank", f"job ({plan.world_size})"],
                row("parameters", "params"), row("gradients", "grads"), row("optimizer state", "optimizer"),
                row("buffers", "buffers"), row("transform state", "transform_state")]
        if worst.ddp_buckets:
            rows.append(row("DDP buckets", "ddp_buckets"))
        if worst.gathered:
            rows.append(row("gathered params", "gathered"))
        if worst.partial_sums:
            rows.append(row("partial sums", "partial_sums"))
        rows.append(["micro-batch peak", size(worst.micro_batch) if worst.micro_batch is not None else "not traced",
                     size(sum(m.micro_batch for m in job)) if worst.micro_batch is not None else ""])
        rows.append(row("persistent", "persistent"))
        rows.append(row("step peak", "peak"))
        if worst.offloaded:
            rows.append(row("of it offloaded", "offloaded"))
        lines += ["", *_table(rows)]
        if plan.device_memory is not None:
            lines.append(f"  device memory {size(plan.device_memory)}: peak at "
                         f"{100 * worst.device_peak / plan.device_memory:.0f}%")
    if plan.recompute is not None:
        r = plan.recompute
        rows = [["checkpoint_activations", "micro-batch peak"],
                *([label, size(peak)] for label, peak in r.peaks.items())]
        lines += ["", *_table(rows), f"  recomputed: {len(r.chosen)} of {len(r.blocks)} blocks"
                  + (f" ({', '.join(r.chosen[:4])}{', ...' if len(r.chosen) > 4 else ''})" if r.chosen else "")
                  + (f"; each block saves {size(r.blocks[0][1])}" if len({b for _, b in r.blocks}) == 1 else "")]
    if plan.comms:
        rows = [["collectives (rank 0)", "dtype", "elements", "bytes", "on wire", "per update"]]
        for c in plan.comms:
            elements = "?" if c.elements is None else str(c.elements)
            rows.append([f"{c.kind} {c.what}", str(c.dtype).removeprefix("torch."), elements, size(c.bytes),
                         size(c.wire_bytes), "per log" if c.per_log else f"x{c.count}"])
        total = sum(c.wire_bytes * c.count for c in plan.comms if not c.per_log and c.wire_bytes is not None)
        unknown = any(c.wire_bytes is None for c in plan.comms)
        lines += ["", *_table(rows), f"  sent per update and rank: {size(total)}"
                  + (" and the collectives of unknown size (?)" if unknown else "")]
    if plan.problems:
        lines += ["", "problems"]
        lines += [f"  {'error' if p.error else 'warning'} {p}" for p in plan.problems]
    else:
        lines += ["", "problems: none found"]
    return "\n".join(lines)
