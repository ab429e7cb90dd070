"""A PNG of a run: one step's pipeline timeline and per-step bandwidth and stall.

    plot_run("run.png", tm.events(), tm.stats())

Needs matplotlib (`pip install 'tiermem[plot]'`), imported only when called and
used through its Agg canvas: no pyplot, no change to the caller's backend.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

from tiermem.telemetry.trace import TRACK_ORDER, _ev, assign_lanes

MISSING = "tiermem --plot needs matplotlib: pip install 'tiermem[plot]'"
COLORS = {
    "step": "#9e9e9e",
    "nvme read": "#1f77b4",
    "host optimizer": "#2ca02c",
    "host<->device": "#9467bd",
    "nvme write": "#ff7f0e",
    "stall": "#d62728",
}


def _import_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(MISSING) from exc
    return Figure, FigureCanvasAgg


def _step_dict(s: Any) -> dict[str, Any]:
    return s if isinstance(s, dict) else s.as_dict()


def pick_step(events: Sequence[Any]) -> int | None:
    """The last step with NVMe reads, else the last step with events; None without events."""
    reads = [_ev(e, "step") for e in events if _ev(e, "track") == "nvme read"]
    if reads:
        return max(reads)
    return max((_ev(e, "step") for e in events), default=None)


def plot_run(path: str | os.PathLike, events: Iterable[Any], steps: Iterable[Any], *,
             step: int | None = None) -> None:
    """Write a PNG to `path`: (top) the pipeline timeline of `step` (default: the last step
    with NVMe reads, else the last), (bottom) read/write GB/s and stall time per step.

    `events` are telemetry.Event (tm.events()); `steps` are tm.stats() dicts or StepStats.
    """
    Figure, FigureCanvasAgg = _import_matplotlib()
    events = list(events)
    steps = [_step_dict(s) for s in steps]
    if step is None:
        step = pick_step(events)
    elif not any(_ev(e, "step") == step for e in events):
        have = sorted({_ev(e, "step") for e in events})
        raise ValueError(f"no timeline events of step {step} (events cover steps "
                         f"{have[0]}..{have[-1]})" if have else
                         f"no timeline events of step {step}: none were recorded")

    build_figure(events, steps, step, Figure, FigureCanvasAgg).savefig(
        os.fspath(path), format="png", dpi=110)


def build_figure(events: list[Any], steps: list[dict[str, Any]], step: int | None,
                 Figure: Any = None, FigureCanvasAgg: Any = None) -> Any:
    """The matplotlib Figure plot_run saves (tests inspect it)."""
    if Figure is None:
        Figure, FigureCanvasAgg = _import_matplotlib()
    steps = [_step_dict(s) for s in steps]
    fig = Figure(figsize=(12, 7), dpi=110)
    FigureCanvasAgg(fig)
    # Fixed margins (no tight/constrained layout), so that bar widths in pixels are known
    # before drawing and partition labels go only where they fit.
    gs = fig.add_gridspec(2, 1, height_ratios=[3, 2], left=0.1, right=0.9, top=0.93,
                          bottom=0.08, hspace=0.38)
    _timeline(fig.add_subplot(gs[0]), [e for e in events if _ev(e, "step") == step], step)
    _per_step(fig.add_subplot(gs[1]), steps, step)
    return fig


def _darker(color: str, f: float = 0.65) -> str:
    r, g, b = (int(color[i: i + 2], 16) for i in (1, 3, 5))
    return "#{:02x}{:02x}{:02x}".format(*(int(c * f) for c in (r, g, b)))


def _timeline(ax, events: list[Any], step: int | None) -> None:
    if not events:
        ax.set_axis_off()
        ax.set_title("Pipeline timeline", loc="left", fontweight="bold")
        ax.text(0.5, 0.5, "no timeline events recorded (call tm.record_events() before the "
                "steps)", ha="center", va="center", transform=ax.transAxes, color="0.4")
        return
    t0 = min(_ev(e, "start") for e in events)
    t1 = max(_ev(e, "end") for e in events)
    span_ms = max((t1 - t0) * 1e3, 1e-3)
    # Only tracks with spans: a CPU-only run has no host<->device lane to show.
    present = {_ev(e, "track") for e in events}
    tracks = [t for t in TRACK_ORDER if t in present] + sorted(present - set(TRACK_ORDER))
    ax.set_xlim(-0.01 * span_ms, 1.01 * span_ms)
    ax.set_ylim(len(tracks) - 0.5, -0.5)  # first track on top
    renderer = ax.figure.canvas.get_renderer()
    x_px = ax.get_window_extent(renderer).width / (1.02 * span_ms)  # pixels per ms

    y_px = ax.get_window_extent(renderer).height / len(tracks)  # pixels per track row
    placed: list[Any] = []  # label extents so far: a label that would touch one is dropped
    step_start = None
    for row, track in enumerate(tracks):
        evs = [e for e in events if _ev(e, "track") == track]
        if not evs:
            continue
        if track == "step":
            step_start = min(_ev(e, "start") for e in evs)
        spans = [((_ev(e, "start") - t0) * 1e3, (_ev(e, "end") - t0) * 1e3) for e in evs]
        lanes = assign_lanes(spans)
        n = max(lanes) + 1
        h = 0.8 / n
        color = COLORS.get(track, "#17becf")
        edge = _darker(color)
        for lane in range(n):
            bars = [(a, b - a) for (a, b), ln in zip(spans, lanes) if ln == lane]
            y = row - 0.4 + lane * h
            # The darker edge keeps microsecond spans visible as hairlines at millisecond
            # scale and separates back-to-back spans.
            ax.broken_barh(bars, (y + 0.05 * h, 0.9 * h), facecolors=color, edgecolors=edge,
                           linewidth=0.6)
        for e, (a, b), lane in zip(evs, spans, lanes):
            part = _ev(e, "partition")
            label = _ev(e, "name") if part is None else f"p{part}"
            if track == "step":
                label = f"step {step}  ({b - a:.1f} ms)"
            if (b - a) * x_px < 8:
                continue
            text = ax.text((a + b) / 2, row - 0.4 + (lane + 0.5) * h, label, ha="center",
                           va="center", fontsize=7, clip_on=True,
                           color="white" if track != "step" else "black")
            box = text.get_window_extent(renderer)
            if (box.width + 2 > (b - a) * x_px or box.height > h * y_px
                    or any(box.overlaps(other) for other in placed)):
                text.remove()  # does not fit in its bar or sub-row, or touches another label
            else:
                placed.append(box)
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels(tracks)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("time from the step's first event (ms)")
    ax.grid(axis="x", color="0.9")
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)

    n_reads = sum(_ev(e, "track") == "nvme read" for e in events)
    n_writes = sum(_ev(e, "track") == "nvme write" for e in events)
    title = f"Pipeline timeline of step {step}: {n_reads} NVMe reads, {n_writes} writes"
    ax.set_title(title, loc="left", fontweight="bold")
    if step_start is not None and step_start > t0:
        # Reads of this step's first partitions, issued at the end of the previous step.
        x = (step_start - t0) * 1e3
        ax.axvspan(ax.get_xlim()[0], x, color="#1f77b4", alpha=0.07, lw=0)
        ax.axvline(x, color="0.3", ls="--", lw=0.8)
        ax.annotate("step() called", (x, -0.5), xytext=(-3, -2), textcoords="offset points",
                    fontsize=7, ha="right", va="top", color="0.3")
        ax.set_title(f"shaded: before step(), read-ahead issued as step {step - 1} ended",
                     loc="right", fontsize=8, color="0.35")


def _per_step(ax, steps: list[dict[str, Any]], chosen: int | None) -> None:
    ax.set_title("Per step", loc="left", fontweight="bold")
    if not steps:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no step statistics", ha="center", va="center",
                transform=ax.transAxes, color="0.4")
        return
    xs = [s["step"] for s in steps]
    marker = "o" if len(xs) <= 60 else None
    stall = ax.twinx()
    bars = stall.bar(xs, [s["stall_seconds"] * 1e3 for s in steps], width=0.6,
                     color=COLORS["stall"], alpha=0.3, label="stall ms (right)")
    (t,) = stall.plot(xs, [s["step_seconds"] * 1e3 for s in steps], color="0.25", ls="--",
                      marker=marker, ms=3, lw=1.2, label="opt.step() time ms (right)")
    (r,) = ax.plot(xs, [s["read_gbps"] for s in steps], color=COLORS["nvme read"],
                   marker=marker, ms=4, lw=1.6, label="read GB/s")
    (w,) = ax.plot(xs, [s["write_gbps"] for s in steps], color=COLORS["nvme write"],
                   marker=marker, ms=4, lw=1.6, label="write GB/s")
    # Lines above the bars of the twin axis.
    ax.set_zorder(stall.get_zorder() + 1)
    ax.patch.set_visible(False)
    handles = [r, w, t, bars]
    if chosen is not None and chosen in xs:
        handles.append(ax.axvline(chosen, color="0.3", ls=":", lw=1,
                                  label=f"step {chosen} (above)"))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("GB/s (bytes / I/O busy time)")
    stall.set_ylabel("opt.step() time and stall (ms)")
    ax.set_ylim(bottom=0)
    stall.set_ylim(bottom=0)
    if len(xs) <= 20:
        ax.set_xticks(xs)
    ax.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
    ax.grid(axis="y", color="0.9")
    # Above the axes, right of the title: never over the data.
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
              fontsize=8, frameon=False, borderaxespad=0.2, handlelength=1.6)
