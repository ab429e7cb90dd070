"""Timeline events (telemetry.Event) as a Chrome / Perfetto JSON trace.

    trace = chrome_trace(tm.events())     # {"traceEvents": [...], "displayTimeUnit": "ms"}
    write_chrome_trace("run.json", tm.events())

Open the file in https://ui.perfetto.dev or chrome://tracing. Each track
(step, nvme read, host optimizer, host<->device, nvme write, stall) is one
thread of process 1, in that order. Every event is a complete event ("ph": "X")
with "ts"/"dur" in microseconds from the earliest event and args {step, partition}.

The JSON format requires the complete events of one thread to nest properly;
Perfetto and chrome://tracing misdraw ones that merely overlap. NVMe reads and
writes of a track can be in flight together (prefetch_depth > 1, write-behind),
so a track's overlapping spans go to extra lanes: threads named "nvme read #2",
"nvme read #3", ... (tid = track tid + 100 * lane) drawn right under the track.
Lane 0 keeps the track's fixed tid. Standard library only.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable

# Track order in the viewer; the tid of lane 0 of a track is its position + 1.
TRACK_ORDER = ("step", "nvme read", "host optimizer", "host<->device", "nvme write", "stall")
TRACK_TIDS = {name: i + 1 for i, name in enumerate(TRACK_ORDER)}
LANE_STRIDE = 100  # tid of lane j of a track: track tid + LANE_STRIDE * j
PID = 1
PHASES = ("X", "M")  # what tiermem traces contain
METADATA_NAMES = ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
_EPS_US = 1e-3  # 1 ns: slack for float rounding when checking nesting


def _ev(e: Any, key: str) -> Any:
    """A field of an Event, or of a dict with the same keys."""
    return e[key] if isinstance(e, dict) else getattr(e, key)


def track_tids(tracks: Iterable[str]) -> dict[str, int]:
    """The lane-0 tid of each track: the fixed ones, then unknown tracks by name (7, 8, ...)."""
    tids = dict(TRACK_TIDS)
    for name in sorted(set(tracks) - set(tids)):
        tids[name] = len(tids) + 1
    if len(tids) >= LANE_STRIDE:
        raise ValueError(f"{len(tids)} tracks: at most {LANE_STRIDE - 1} fit the tid scheme")
    return tids


def assign_lanes(spans: list[tuple[float, float]]) -> list[int]:
    """For (start, end) spans of one track, a lane per span such that spans of one lane never
    overlap (touching is fine): each span takes the lowest lane free at its start."""
    lanes = [0] * len(spans)
    lane_end: list[float] = []
    for i in sorted(range(len(spans)), key=lambda i: (spans[i][0], spans[i][1])):
        a, b = spans[i]
        for j, end in enumerate(lane_end):
            if end <= a:
                break
        else:
            j = len(lane_end)
            lane_end.append(b)
        lane_end[j] = b
        lanes[i] = j
    return lanes


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def chrome_trace(events: Iterable[Any], *, process_name: str = "tiermem") -> dict[str, Any]:
    """The Chrome/Perfetto JSON trace (a dict, ready for json.dump) of timeline events."""
    events = list(events)
    for i, e in enumerate(events):
        start, end = _ev(e, "start"), _ev(e, "end")
        if not (math.isfinite(start) and math.isfinite(end)):
            raise ValueError(f"event {i} ({_ev(e, 'name')!r}): start/end not finite "
                             f"({start}, {end})")
        if end < start:
            raise ValueError(f"event {i} ({_ev(e, 'name')!r}) ends before it starts "
                             f"({start} > {end})")
    t0 = min((_ev(e, "start") for e in events), default=0.0)
    tids = track_tids(_ev(e, "track") for e in events)

    by_track: dict[str, list[int]] = {}
    for i, e in enumerate(events):
        by_track.setdefault(_ev(e, "track"), []).append(i)
    spans_us = [(_us(_ev(e, "start") - t0), _us(_ev(e, "end") - _ev(e, "start")))
                for e in events]
    tid_of = [0] * len(events)
    lanes_used: dict[str, int] = {}
    for track, idx in by_track.items():
        # Lanes from the values written out, so that the file nests exactly as checked.
        lanes = assign_lanes([(spans_us[i][0], spans_us[i][0] + spans_us[i][1]) for i in idx])
        for i, lane in zip(idx, lanes):
            tid_of[i] = tids[track] + LANE_STRIDE * lane
        lanes_used[track] = max(lanes) + 1

    meta: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": PID, "tid": 0,
         "args": {"name": process_name}},
        {"ph": "M", "name": "process_sort_index", "pid": PID, "tid": 0,
         "args": {"sort_index": 0}},
    ]
    for track, tid in tids.items():
        for lane in range(lanes_used.get(track, 1)):
            name = track if lane == 0 else f"{track} #{lane + 1}"
            meta.append({"ph": "M", "name": "thread_name", "pid": PID,
                         "tid": tid + LANE_STRIDE * lane, "args": {"name": name}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": PID,
                         "tid": tid + LANE_STRIDE * lane,
                         "args": {"sort_index": tid * LANE_STRIDE + lane}})

    spans = []
    for i, e in enumerate(events):
        ts, dur = spans_us[i]
        part = _ev(e, "partition")
        spans.append({"ph": "X", "name": str(_ev(e, "name")), "cat": _ev(e, "track"),
                      "ts": ts, "dur": dur, "pid": PID, "tid": tid_of[i],
                      "args": {"step": int(_ev(e, "step")),
                               "partition": None if part is None else int(part)}})
    spans.sort(key=lambda x: (x["ts"], x["tid"]))
    return {"traceEvents": meta + spans, "displayTimeUnit": "ms",
            "otherData": {"source": "tiermem", "clock": "time.monotonic",
                          "t0_seconds": t0}}


def write_chrome_trace(path: str | os.PathLike, events: Iterable[Any], *,
                       process_name: str = "tiermem") -> dict[str, Any]:
    """Write chrome_trace(events) as JSON to `path`; returns the trace."""
    trace = chrome_trace(events, process_name=process_name)
    with open(path, "w") as f:
        json.dump(trace, f, allow_nan=False, separators=(",", ":"))
        f.write("\n")
    return trace


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_chrome_trace(obj: Any) -> None:
    """Check that `obj` has the shape chrome_trace() documents; raise ValueError saying what
    is wrong. Checks: a "traceEvents" list of dicts, each with a known "ph"; complete events
    with a name, finite ts >= 0 and dur >= 0, integer pid/tid and dict args; metadata events
    of a known name with the args they need; every thread with a complete event named; the
    complete events of each thread properly nested; the whole JSON-serialisable."""
    if not isinstance(obj, dict):
        raise ValueError(f"trace is a {type(obj).__name__}, not a dict with 'traceEvents'")
    if "traceEvents" not in obj:
        raise ValueError("trace has no 'traceEvents' key")
    evs = obj["traceEvents"]
    if not isinstance(evs, list):
        raise ValueError(f"'traceEvents' is a {type(evs).__name__}, not a list")
    if "displayTimeUnit" in obj and obj["displayTimeUnit"] not in ("ms", "ns"):
        raise ValueError(f"displayTimeUnit {obj['displayTimeUnit']!r} is neither 'ms' nor 'ns'")
    named: set[tuple[int, int]] = set()
    per_thread: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for i, ev in enumerate(evs):
        where = f"traceEvents[{i}]"
        if not isinstance(ev, dict):
            raise ValueError(f"{where} is a {type(ev).__name__}, not a dict")
        ph = ev.get("ph")
        if ph not in PHASES:
            raise ValueError(f"{where}: unknown ph {ph!r} (tiermem traces use {PHASES})")
        name = ev.get("name")
        if not isinstance(name, str):
            raise ValueError(f"{where}: name {name!r} is not a string")
        where = f"{where} ({name!r})"
        for key in ("pid", "tid"):
            if not _int(ev.get(key)):
                raise ValueError(f"{where}: {key} {ev.get(key)!r} is not an integer")
        args = ev.get("args", {})
        if not isinstance(args, dict):
            raise ValueError(f"{where}: args is a {type(args).__name__}, not a dict")
        if ph == "M":
            if name not in METADATA_NAMES:
                raise ValueError(f"{where}: unknown metadata name (expected one of "
                                 f"{METADATA_NAMES})")
            if name.endswith("_name") and not isinstance(args.get("name"), str):
                raise ValueError(f"{where}: args.name {args.get('name')!r} is not a string")
            if name.endswith("_sort_index") and not _int(args.get("sort_index")):
                raise ValueError(f"{where}: args.sort_index {args.get('sort_index')!r} is not "
                                 "an integer")
            if name == "thread_name":
                named.add((ev["pid"], ev["tid"]))
            continue
        for key in ("ts", "dur"):
            if key not in ev:
                raise ValueError(f"{where}: complete event without {key!r}")
            if not _number(ev[key]):
                raise ValueError(f"{where}: {key} {ev[key]!r} is not a finite number")
        if ev["ts"] < 0:
            raise ValueError(f"{where}: negative ts {ev['ts']}")
        if ev["dur"] < 0:
            raise ValueError(f"{where}: negative dur {ev['dur']}")
        per_thread.setdefault((ev["pid"], ev["tid"]), []).append(
            (ev["ts"], ev["ts"] + ev["dur"], name))
    for (pid, tid), spans in per_thread.items():
        if (pid, tid) not in named:
            raise ValueError(f"pid {pid} tid {tid} has complete events but no thread_name")
        stack: list[tuple[float, float, str]] = []
        for a, b, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= a + _EPS_US:
                stack.pop()
            if stack and b > stack[-1][1] + _EPS_US:
                pa, pb, pname = stack[-1]
                raise ValueError(f"tid {tid}: {name!r} [{a}, {b}] overlaps {pname!r} "
                                 f"[{pa}, {pb}] without nesting in it")
            stack.append((a, b, name))
    try:
        json.dumps(obj, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"trace is not JSON-serialisable: {exc}") from None
