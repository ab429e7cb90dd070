"""Timeline events as a Chrome/Perfetto trace (tiermem.telemetry.trace) and as a PNG (tiermem.telemetry.plot)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tiermem
from tiermem.telemetry.stats import Event
from tiermem.telemetry.trace import (LANE_STRIDE, TRACK_ORDER, TRACK_TIDS, assign_lanes, chrome_trace,
                           validate_chrome_trace, write_chrome_trace)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def small_run(swap_dir, *, zigzag: bool, steps: int = 3):
    """Events and stats of a few steps of a two-layer model, most partitions on NVMe."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(300, 517), torch.nn.Linear(517, 200))
    o = torch.optim.AdamW(m.parameters())
    cfg = {"swap": {"paths": [str(swap_dir)]}, "tiers": {"host": {"capacity": "256KiB"}},
           "pipeline": {"partition_size": "128KiB", "zigzag": zigzag}}
    with tiermem.offload(o, cfg) as tm:
        tm.record_events()
        for _ in range(steps):
            m(torch.randn(8, 300)).sum().backward()
            o.step()
            o.zero_grad()
        return tm.events(), tm.stats()


@pytest.fixture(scope="module", params=[True, False], ids=["zigzag", "no-zigzag"])
def run(request, tmp_path_factory):
    """(events, stats, zigzag) of a small real run; without zigzag, reads run ahead."""
    events, stats = small_run(tmp_path_factory.mktemp("swap"), zigzag=request.param)
    return events, stats, request.param


def spans(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def thread_names(trace: dict) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def track_of_tid(tid: int) -> str:
    return TRACK_ORDER[tid % LANE_STRIDE - 1]


# -- the trace of a real run -------------------------------------------------------------


def test_real_run_trace_validates_and_round_trips(run, tmp_path):
    events, _, _ = run
    assert events, "record_events() gave no events"
    trace = chrome_trace(events)
    validate_chrome_trace(trace)
    assert trace["displayTimeUnit"] == "ms"
    assert json.loads(json.dumps(trace)) == trace
    path = tmp_path / "run.json"
    written = write_chrome_trace(path, events)
    loaded = json.loads(path.read_text())
    assert loaded == written == trace
    validate_chrome_trace(loaded)


def test_every_event_appears_once_on_its_track(run):
    events, _, _ = run
    trace = chrome_trace(events)
    xs = spans(trace)
    assert len(xs) == len(events)
    names = thread_names(trace)
    t0 = min(e.start for e in events)
    want = Counter((e.track, e.name, e.step, e.partition, round((e.start - t0) * 1e6, 3))
                   for e in events)
    got = Counter((x["cat"], x["name"], x["args"]["step"], x["args"]["partition"], x["ts"])
                  for x in xs)
    assert got == want
    for x in xs:
        assert track_of_tid(x["tid"]) == x["cat"]
        assert names[x["tid"]].startswith(x["cat"])
        lane = x["tid"] // LANE_STRIDE
        assert names[x["tid"]] == (x["cat"] if lane == 0 else f"{x['cat']} #{lane + 1}")
    # Spans that do not overlap others of their track sit on the track's own tid.
    assert {x["tid"] for x in xs if x["cat"] == "step"} == {TRACK_TIDS["step"]}
    assert {x["tid"] for x in xs if x["cat"] == "host optimizer"} == {
        TRACK_TIDS["host optimizer"]}


def test_times_are_microseconds_from_the_first_event(run):
    events, _, _ = run
    xs = spans(chrome_trace(events))
    assert min(x["ts"] for x in xs) == 0
    assert all(x["ts"] >= 0 and x["dur"] >= 0 for x in xs)
    t0 = min(e.start for e in events)
    longest = max(events, key=lambda e: e.end - e.start)
    match = [x for x in xs if x["name"] == longest.name and x["args"]["step"] == longest.step]
    assert any(math.isclose(x["dur"], (longest.end - longest.start) * 1e6, abs_tol=0.01)
               and math.isclose(x["ts"], (longest.start - t0) * 1e6, abs_tol=0.01)
               for x in match)


def test_tracks_are_named_and_ordered(run):
    events, _, _ = run
    trace = chrome_trace(events, process_name="my run")
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert {"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
            "args": {"name": "my run"}} in meta
    assert TRACK_TIDS == {"step": 1, "nvme read": 2, "host optimizer": 3, "host<->device": 4,
                          "nvme write": 5, "stall": 6}
    names = thread_names(trace)
    sort = {e["tid"]: e["args"]["sort_index"] for e in meta if e["name"] == "thread_sort_index"}
    assert set(sort) == set(names)
    ordered = [names[tid] for tid in sorted(sort, key=sort.get)]
    assert [n for n in ordered if "#" not in n] == list(TRACK_ORDER)
    for i, name in enumerate(ordered):  # extra lanes right under their track
        if "#" in name:
            assert ordered[i - 1].split(" #")[0] == name.split(" #")[0]


def test_read_ahead_shows_before_the_step(run):
    """Reads issued at the end of step t belong to step t+1 and start before its step span."""
    events, _, zigzag = run
    xs = spans(chrome_trace(events))
    step_ts = {x["args"]["step"]: x["ts"] for x in xs if x["cat"] == "step"}
    early = [x for x in xs if x["cat"] == "nvme read" and x["ts"] < step_ts[x["args"]["step"]]]
    if zigzag:
        # The partitions read first in a step are still in buffers: nothing is read ahead.
        assert not early
    else:
        assert early
        assert all(x["args"]["step"] > 1 for x in early)


def test_step_stats_and_events_agree(run):
    events, stats, _ = run
    assert [s["step"] for s in stats] == sorted({e.step for e in events})
    for s, after in zip(stats, [*stats[1:], None]):
        reads = [e for e in events if e.step == s["step"] and e.track == "nvme read"]
        writes = [e for e in events if e.step == s["step"] and e.track == "nvme write"]
        assert bool(reads) == bool(s["read_bytes"].get("nvme"))
        # every record updated is written back, but those whose write-back was deferred
        # (pipeline.write_back): the next step updates them again, or the exit flushes them
        if after is not None:
            assert len(writes) + after["writes_deferred"] == s["partitions"]["nvme"]
        else:
            assert 0 < len(writes) <= s["partitions"]["nvme"]


# -- validate_chrome_trace ------------------------------------------------------------------


def _good() -> dict:
    return chrome_trace([Event("step", "step", 10.0, 10.5, 1),
                         Event("nvme read", "read p1", 10.1, 10.2, 1, 1),
                         Event("host optimizer", "adam p1", 10.2, 10.3, 1, 1)])


def _first_x(t: dict) -> dict:
    return next(e for e in t["traceEvents"] if e["ph"] == "X")


def _drop_thread_names(t: dict) -> None:
    t["traceEvents"] = [e for e in t["traceEvents"] if e["name"] != "thread_name"]


def _overlap(t: dict) -> None:
    x = [e for e in t["traceEvents"] if e["ph"] == "X"]
    x[2]["tid"] = x[1]["tid"]  # read p1 [100ms, 200ms] and adam p1 [200ms, 300ms] touch
    x[2]["ts"] = x[1]["ts"] + 50_000


BROKEN = {
    "not a dict": (lambda t: [t], "trace is a list"),
    "missing traceEvents": (lambda t: t.pop("traceEvents"), "traceEvents"),
    "traceEvents not a list": (lambda t: t.update(traceEvents={}), "not a list"),
    "event not a dict": (lambda t: t["traceEvents"].append("X"), "not a dict"),
    "unknown ph": (lambda t: _first_x(t).update(ph="Q"), "unknown ph 'Q'"),
    "no ph": (lambda t: _first_x(t).pop("ph"), "unknown ph None"),
    "negative dur": (lambda t: _first_x(t).update(dur=-1.0), "negative dur"),
    "negative ts": (lambda t: _first_x(t).update(ts=-3), "negative ts"),
    "no dur": (lambda t: _first_x(t).pop("dur"), "without 'dur'"),
    "ts not a number": (lambda t: _first_x(t).update(ts="0"), "ts '0' is not a finite number"),
    "dur NaN": (lambda t: _first_x(t).update(dur=float("nan")), "dur nan"),
    "dur bool": (lambda t: _first_x(t).update(dur=True), "dur True"),
    "tid not int": (lambda t: _first_x(t).update(tid="1"), "tid '1'"),
    "name missing": (lambda t: _first_x(t).pop("name"), "name None"),
    "args not a dict": (lambda t: _first_x(t).update(args=[]), "args is a list"),
    "unknown metadata": (lambda t: t["traceEvents"][0].update(name="colour"),
                         "unknown metadata name"),
    "thread name not a string": (
        lambda t: next(e for e in t["traceEvents"] if e["name"] == "thread_name")["args"]
        .update(name=3), "args.name 3"),
    "sort index not int": (
        lambda t: next(e for e in t["traceEvents"] if e["name"] == "thread_sort_index")["args"]
        .update(sort_index="1"), "args.sort_index '1'"),
    "unnamed thread": (_drop_thread_names, "no thread_name"),
    "overlap on one thread": (_overlap, "without nesting"),
    "bad displayTimeUnit": (lambda t: t.update(displayTimeUnit="s"), "displayTimeUnit"),
    "not JSON": (lambda t: _first_x(t)["args"].update(step={1, 2}), "JSON"),
}


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_validate_rejects_broken_shapes(what):
    """Each mutation of a good trace is refused with a message that names the problem."""
    break_it, message = BROKEN[what]
    trace = _good()
    validate_chrome_trace(trace)
    result = break_it(trace)  # mutates in place; "not a dict" returns a new object instead
    broken = result if what == "not a dict" else trace
    with pytest.raises(ValueError) as err:
        validate_chrome_trace(broken)
    assert message in str(err.value), str(err.value)


def test_nested_spans_on_one_thread_are_accepted():
    trace = _good()
    x = spans(trace)
    x[1]["tid"] = x[0]["tid"]  # read p1 lies inside the step span: nesting is fine
    validate_chrome_trace(trace)


def test_chrome_trace_refuses_backwards_events():
    with pytest.raises(ValueError, match="ends before it starts"):
        chrome_trace([Event("stall", "wait p1", 2.0, 1.0, 1, 1)])
    with pytest.raises(ValueError, match="not finite"):
        chrome_trace([Event("stall", "wait p1", 2.0, float("inf"), 1, 1)])


def test_empty_and_dict_events():
    validate_chrome_trace(chrome_trace([]))
    ev = [Event("nvme write", "write p0", 5.0, 5.25, 2, 0)]
    assert chrome_trace([dataclasses.asdict(e) for e in ev]) == chrome_trace(ev)


def test_overlapping_io_goes_to_extra_lanes():
    ev = [Event("nvme read", f"read p{i}", 1.0 + i * 1e-3, 1.01 + i * 1e-3, 1, i)
          for i in range(3)]
    ev.append(Event("nvme read", "read p9", 1.02, 1.03, 1, 9))  # after all three: lane 0
    trace = chrome_trace(ev)
    validate_chrome_trace(trace)
    tid = {x["name"]: x["tid"] for x in spans(trace)}
    assert tid == {"read p0": 2, "read p1": 102, "read p2": 202, "read p9": 2}
    assert thread_names(trace)[202] == "nvme read #3"


# -- properties ------------------------------------------------------------------------------

_event = st.builds(
    Event,
    track=st.sampled_from(TRACK_ORDER),
    name=st.text(min_size=0, max_size=12),
    start=st.floats(0, 1e3, allow_nan=False),
    end=st.just(0.0),  # replaced below: end = start + duration
    step=st.integers(1, 1000),
    partition=st.none() | st.integers(0, 10**6),
)


@st.composite
def event_lists(draw):
    base = draw(st.floats(0, 1e6, allow_nan=False))
    evs = draw(st.lists(_event, max_size=40))
    for e in evs:
        e.start += base
        e.end = e.start + draw(st.sampled_from([0.0, 1e-9, 1e-7, 1e-6])
                               | st.floats(0, 5.0, allow_nan=False))
    return evs


@given(event_lists())
def test_any_event_list_gives_a_valid_trace(evs):
    trace = chrome_trace(evs)
    validate_chrome_trace(trace)
    validate_chrome_trace(json.loads(json.dumps(trace)))
    xs = spans(trace)
    assert len(xs) == len(evs)
    assert Counter(x["cat"] for x in xs) == Counter(e.track for e in evs)
    assert all(track_of_tid(x["tid"]) == x["cat"] for x in xs)
    assert all(x["ts"] >= 0 and x["dur"] >= 0 for x in xs)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=30))
def test_lanes_never_overlap(pairs):
    spans_ = [(float(a), float(a + d)) for a, d in pairs]
    lanes = assign_lanes(spans_)
    for lane in set(lanes):
        mine = sorted(s for s, ln in zip(spans_, lanes) if ln == lane)
        assert all(b[0] >= a[1] for a, b in zip(mine, mine[1:]))
    # Greedy by start uses no more lanes than the most spans meeting at one start.
    if spans_:
        depth = max(sum(a <= t <= b for a, b in spans_) for t, _ in spans_)
        assert max(lanes) + 1 <= depth


# -- plot_run -------------------------------------------------------------------------------


def test_plot_run_writes_a_png(run, tmp_path):
    pytest.importorskip("matplotlib")
    from tiermem.telemetry.plot import pick_step, plot_run

    events, stats, _ = run
    assert pick_step(events) == max(e.step for e in events if e.track == "nvme read")
    for step in (None, 1):
        path = tmp_path / f"run-{step}.png"
        plot_run(path, events, stats, step=step)
        data = path.read_bytes()
        assert len(data) > 10_000
        assert data[:8] == PNG_SIGNATURE


def test_plot_run_edge_cases(tmp_path):
    pytest.importorskip("matplotlib")
    from tiermem.telemetry.plot import pick_step, plot_run

    ev = [Event("step", "step", 1.0, 1.2, 1), Event("host optimizer", "adam p0", 1.0, 1.1, 1, 0)]
    assert pick_step(ev) == 1  # no NVMe reads: the last step
    assert pick_step([]) is None
    for name, events, steps in [("none", [], []), ("no-stats", ev, []),
                                ("host-only", ev, [{"step": 1, "read_gbps": 0.0,
                                                    "write_gbps": 0.0,
                                                    "stall_seconds": 0.0,
                                                    "step_seconds": 0.2}])]:
        path = tmp_path / f"{name}.png"
        plot_run(path, events, steps)
        assert path.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="no timeline events of step 7"):
        plot_run(tmp_path / "x.png", ev, [], step=7)


def test_plot_run_without_matplotlib(monkeypatch, tmp_path):
    from tiermem.telemetry.plot import plot_run

    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends",
                "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(ImportError) as err:
        plot_run(tmp_path / "x.png", [], [])
    assert str(err.value) == "tiermem --plot needs matplotlib: pip install 'tiermem[plot]'"
    assert not (tmp_path / "x.png").exists()


def test_updates_show_in_torch_profiler(tmp_path):
    """Each partition update is a record_function range named `tiermem.update p<N>`."""
    import tiermem
    from torch.profiler import profile

    m = torch.nn.Linear(64, 64)
    o = torch.optim.AdamW(m.parameters())
    with tiermem.offload(o, {"swap": {"paths": [str(tmp_path)]}}):
        m(torch.randn(2, 64)).sum().backward()
        with profile() as prof:
            o.step()
    assert any(e.key.startswith("tiermem.update p") for e in prof.key_averages())
