"""Issue 16, "a user's first hour", through the `tiermem` command: every input error is one line
and exit 2, validate/probe/stress share the swap-path checker, and the commands a new user
reaches for (--version, doctor, plan, ls, clean, init-config) exist and say true things."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest
import yaml

from tiermem.config import load_config

from zygote import run_python


def shipped_configs():
    from tiermem.config import shipped_configs as shipped  # new with issue 16
    return shipped()


def tiermem(*args, cwd=None):
    # `python -m tiermem`, forked with torch imported (tests/zygote.py)
    return run_python("-m", "tiermem", *args, cwd=cwd, timeout=120)


def _one_error_line(proc, needle):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture
def swap(tmp_path):
    d = tmp_path / "swap"
    d.mkdir(mode=0o700)
    return d


def _cfg(tmp_path, text):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


# -- 3. the command itself ------------------------------------------------------------


def test_bare_command_prints_help_and_version_exists():
    proc = tiermem()
    assert proc.returncode == 0 and "usage: tiermem" in proc.stdout
    for cmd in ("probe", "stress", "validate", "doctor", "plan", "ls", "clean", "init-config"):
        assert cmd in proc.stdout
    proc = tiermem("--version")
    assert proc.returncode == 0
    import tiermem as pkg
    assert proc.stdout.strip() == f"tiermem {pkg.__version__}"


def test_impossible_shape_is_one_line_not_a_traceback():
    _one_error_line(tiermem("stress", "--params", "100K", "--layers", "4", "--hidden", "1024"),
                    "--layers 4 of --hidden 1024 already hold")


def test_steps_and_seed_have_help():
    out = tiermem("stress", "--help").stdout
    out = out[out.index("options:"):]  # past the usage line, which names them too
    steps = out[out.index("--steps"):out.index("--grad-accum")]
    seed = out[out.index("--seed"):out.index("--json")]
    assert "optimizer steps" in steps and "seeds" in seed


def test_validate_prints_yaml_with_sizes_as_written(tmp_path, swap):
    cfg = _cfg(tmp_path, f"swap: {{paths: [{swap}]}}\ntiers: {{host: {{capacity: 3GiB}}}}\n")
    proc = tiermem("validate", cfg)
    assert proc.returncode == 0, proc.stderr
    assert "capacity: 3GiB" in proc.stdout and str(3 << 30) not in proc.stdout
    assert "Settings(" not in proc.stdout
    body = proc.stdout.split("\n", 1)[1].split("swap paths:")[0]
    assert load_config(yaml.safe_load(body)) == load_config(cfg)  # it is a config itself


def test_yaml_error_names_the_file_and_line(tmp_path):
    cfg = _cfg(tmp_path, "swap:\n  paths: [a\ntiers: {}\n")
    proc = tiermem("validate", cfg)
    _one_error_line(proc, f"config file {cfg}: not valid YAML at line 3")
    assert "<unicode string>" not in proc.stderr


# -- 2. one path checker for validate, probe, stress -----------------------------------


def test_validate_refuses_paths_offload_would_refuse(tmp_path, swap):
    (tmp_path / "link").symlink_to(swap)
    cases = {
        "/proc/tiermem": "virtual filesystem",
        str(tmp_path / "link"): "symbolic link",
        str(tmp_path / "mnt" / "nvme0" / "tiermem"): "does not exist (is the drive mounted?)",
        "relative/swap": "is relative",
    }
    for path, needle in cases.items():
        proc = tiermem("validate", _cfg(tmp_path, f"swap: {{paths: ['{path}']}}\n"))
        _one_error_line(proc, needle)
    proc = tiermem("validate", _cfg(tmp_path, f"swap: {{paths: ['{swap}', '{swap}/']}}\n"))
    _one_error_line(proc, "are the same directory")
    assert not (tmp_path / "mnt").exists()


def test_validate_warns_when_stripes_share_a_device(tmp_path, swap):
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    proc = tiermem("validate", _cfg(tmp_path, f"swap: {{paths: ['{swap}', '{other}']}}\n"))
    assert proc.returncode == 0, proc.stderr
    assert "are on one device" in proc.stdout


def test_validate_says_when_a_path_is_not_on_a_drive_of_its_own(tmp_path, swap):
    """The multi-nvme example ran on the root disk and nothing said so: validate names the
    mount a path is on, and says when that is the root filesystem."""
    from tiermem.sysinfo import mount_of
    proc = tiermem("validate", _cfg(tmp_path, f"swap: {{paths: ['{swap}']}}\n"))
    assert proc.returncode == 0, proc.stderr
    m = mount_of(str(swap))
    assert f"mounted at {m.mountpoint}" in proc.stdout
    if m.mountpoint == "/":
        assert "is on the root filesystem, not on a drive mounted for it" in proc.stdout


def test_shipped_multi_nvme_config_says_what_it_needs():
    text = shipped_configs()["multi-nvme"].read_text()
    assert "mount points of two different drives" in text


def test_probe_refuses_a_symlink_instead_of_recommending_it(tmp_path, swap):
    (tmp_path / "link").symlink_to(swap)
    proc = tiermem("probe", tmp_path / "link", "--size", "4MiB", "--backend", "threads")
    assert proc.returncode == 1
    assert "symbolic link" in proc.stdout and "recommended config" not in proc.stdout


def test_probe_every_path_with_progress_and_leaves_nothing(tmp_path, swap):
    made = tmp_path / "new"  # the probe creates it, and removes it again
    cfg = _cfg(tmp_path, f"swap: {{paths: ['{swap}', '{made}']}}\n")
    proc = tiermem("probe", "--config", cfg, "--size", "4MiB", "--block-sizes", "1MiB",
                   "--depths", "4", "--backend", "threads")
    assert proc.returncode == 0, proc.stderr
    assert f"probing {swap}" in proc.stdout and f"probing {made}" in proc.stdout
    # the progress line of the first path comes before the second is started
    assert proc.stdout.index("threads") < proc.stdout.index(f"probing {made}")
    assert "stripes: swap paths" in proc.stdout and "one device" in proc.stdout
    assert not made.exists() and os.listdir(swap) == []


def test_probe_warns_on_tmpfs():
    from tiermem.sysinfo import mount_of
    if mount_of("/dev/shm").fstype != "tmpfs" or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    path = f"/dev/shm/tiermem-probe-test-{os.getpid()}"  # new: probe made it, so it removes it
    assert not os.path.exists(path)
    try:
        proc = tiermem("probe", path, "--size", "4MiB", "--block-sizes", "1MiB", "--depths",
                       "4", "--backend", "threads")
        assert "warning: is on tmpfs" in proc.stdout
        assert not os.path.exists(path)
    finally:
        if os.path.isdir(path):
            os.rmdir(path)


def test_stress_on_a_virtual_filesystem_names_the_path_not_the_free_space(tmp_path):
    cfg = _cfg(tmp_path, "swap: {paths: [/proc/tiermem]}\ntiers: {host: {capacity: 0}}\n")
    proc = tiermem("stress", "--config", cfg, "--params", "1M", "--no-progress")
    _one_error_line(proc, "/proc/tiermem: is on proc, a virtual filesystem")
    assert "overflows" not in proc.stderr


# -- 3. the new commands --------------------------------------------------------------


def test_doctor_reports_each_topic(tmp_path, swap):
    cfg = _cfg(tmp_path, f"swap: {{paths: ['{swap}']}}\n")
    proc = tiermem("doctor", "--config", cfg)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for topic in ("kernel", "io_uring", "swap path", "memlock", "huge pages", "native Adam",
                  "torch", "CUDA"):
        assert topic in proc.stdout, topic
    assert f"{swap} (" in proc.stdout and "O_DIRECT" in proc.stdout
    assert os.listdir(swap) == []
    bad = _cfg(tmp_path, "swap: {paths: [/proc/tiermem]}\n")
    proc = tiermem("doctor", "--config", bad)
    assert proc.returncode == 1 and "ERROR swap path" in proc.stdout


def _plan_cfg(tmp_path, swap):
    return _cfg(tmp_path, f"swap: {{paths: ['{swap}']}}\ntiers: {{host: {{capacity: 0}}}}\n"
                          "pipeline: {partition_size: 64MiB, buffer_count: 4}\n")


def test_plan_estimates_from_probe_figures(tmp_path, swap):
    """The step time is the larger of the NVMe floor (probe rates) and the update floor (the
    kernel's ns/param), and the plan says which one dominates."""
    cfg = _plan_cfg(tmp_path, swap)
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"measurements": [
        {"backend": "io_uring", "block_size": 1 << 20, "queue_depth": 8, "write_gbps": 1.0,
         "read_gbps": 2.0}]}))
    proc = tiermem("plan", "--config", cfg, "--params", "1B", "--probe", probe,
                   "--no-activations", "--update-ns", "2")
    assert proc.returncode in (0, 1), proc.stderr
    # 1B fp32 params: 8 GB of state on NVMe; zigzag skips the 4 x 64 MiB still buffered,
    # both ways (their write-back is deferred)
    nvme = 8_000_000_000
    io = (nvme - 4 * (64 << 20)) / 2e9 + (nvme - 4 * (64 << 20)) / 1e9
    assert f"NVMe floor: {io:.3g} s (at 2 GB/s read and 1 GB/s write" in proc.stdout
    assert "update floor: 2 s (1,000,000,000 parameters updated on the CPU at 2 ns/param, " \
           "kernel native, given)" in proc.stdout
    assert f"estimated opt.step() time ~{io:.3g} s: NVMe-bound ({io / 2:.2g}x the update " \
           "floor" in proc.stdout
    assert os.listdir(swap) == []
    _one_error_line(tiermem("plan", "--params", "1B", "--probe", tmp_path / "nope.json"),
                    "--probe")


def test_plan_says_when_the_update_dominates(tmp_path, swap):
    cfg = _plan_cfg(tmp_path, swap)
    proc = tiermem("plan", "--config", cfg, "--params", "1B", "--read-gbps", "20",
                   "--write-gbps", "20", "--no-activations", "--update-ns", "5")
    io = 2 * (8e9 - 4 * (64 << 20)) / 20e9  # the buffered records neither read nor written
    assert "update floor: 5 s" in proc.stdout
    assert f"estimated opt.step() time ~5 s: update-bound ({5 / io:.2g}x the NVMe floor" \
        in proc.stdout, proc.stdout
    # match runs the plain optimizer's CPU kernel; the plan names it
    cfg2 = _cfg(tmp_path, cfg.read_text() + "optimizer: {kernel: match}\n")
    proc = tiermem("plan", "--config", cfg2, "--params", "1B", "--no-activations",
                   "--update-ns", "5")
    assert "kernel single_tensor, given" in proc.stdout
    assert "estimated opt.step() time >= 5 s (update floor; the NVMe floor is unknown)" \
        in proc.stdout
    _one_error_line(tiermem("plan", "--params", "1B", "--read-gbps", "0"), "--read-gbps")


def test_plan_measures_the_update_kernel_and_allocates_no_state(tmp_path, swap):
    cfg = _plan_cfg(tmp_path, swap)
    proc = tiermem("plan", "--config", cfg, "--params", "10M", "--no-activations",
                   "--read-gbps", "1", "--write-gbps", "1")
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("update floor"))
    assert "kernel native, measured here on 4M elements" in line, line
    ns = float(line.split(" ns/param")[0].rsplit(" ", 1)[1])
    assert ns > 0
    assert "-bound (" in proc.stdout
    assert os.listdir(swap) == []  # the plan wrote nothing to the swap path


def _run_dir(swap: Path, name: str, manifest: dict | None) -> Path:
    d = swap / f"tiermem-{name}"
    d.mkdir(mode=0o700)
    (d / "swap-0.bin").write_bytes(b"\0" * 8192)
    (d / "owner.json").write_text(json.dumps({"pid": 4242, "host": "h", "started": "then"}))
    if manifest is not None:
        (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_ls_and_clean_run_directories(swap):
    stale = _run_dir(swap, "crashed", None)
    kept = _run_dir(swap, "kept", {"step": 3, "durability": "scratch"})
    committed = _run_dir(swap, "ckpt", {"step": 9, "durability": "crash_consistent"})
    live = _run_dir(swap, "live", None)
    holder = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # as a running process holds it
    try:
        out = tiermem("ls", swap).stdout
        states = {Path(ln.split()[0]).name: ln.split()[1] for ln in out.splitlines()}
        assert states == {"tiermem-crashed": "stale", "tiermem-kept": "kept",
                          "tiermem-ckpt": "committed", "tiermem-live": "in"}
        assert "name='kept', resume=True" in out and "committed step 9" in out

        proc = tiermem("clean", swap, "--dry-run")
        assert "would remove" in proc.stdout and stale.exists()
        proc = tiermem("clean", swap)
        assert proc.returncode == 0, proc.stderr
        assert not stale.exists() and kept.exists() and committed.exists() and live.exists()
        assert "give --kept" in proc.stdout
        tiermem("clean", swap, "--kept", "--name", "kept")
        assert not kept.exists() and committed.exists()
        tiermem("clean", swap, "--kept")
        assert not committed.exists() and live.exists()  # never one in use
    finally:
        os.close(holder)


def test_init_config_writes_a_shipped_config(tmp_path):
    proc = tiermem("init-config", "--list")
    assert "nvme" in proc.stdout and "multi-nvme" in proc.stdout
    proc = tiermem("init-config", "nvme", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "nvme.yaml").read_text() == shipped_configs()["nvme"].read_text()
    load_config(tmp_path / "nvme.yaml")
    _one_error_line(tiermem("init-config", "nvme", cwd=tmp_path), "exists")
    _one_error_line(tiermem("init-config", "nope"), "no shipped config")


def test_shipped_configs_are_package_data():
    """The configs travel in the package (the clone's configs/ is a link to them)."""
    import tiermem as pkg
    assert set(shipped_configs()) >= {"default", "nvme", "multi-nvme", "host-only",
                                      "gpu-hybrid"}
    assert all(Path(pkg.__file__).parent in p.parents for p in shipped_configs().values())
    assert "XXH3" not in shipped_configs()["default"].read_text()


# -- 4. stress output -----------------------------------------------------------------


def test_stress_output_off_a_terminal_is_a_plain_labelled_log(tmp_path, swap):
    cfg = _cfg(tmp_path, f"swap: {{paths: ['{swap}']}}\nio: {{backend: threads}}\n"
                         "tiers: {host: {capacity: 64MiB}}\n")
    proc = tiermem("stress", "--config", cfg, "--params", "200K", "--steps", "2",
                   "--synthetic-grads")
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout + proc.stderr
    assert "step 1/2: wall" in proc.stdout and "step 2/2: wall" in proc.stdout
    lines = proc.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("step") and "overlap" in ln)
    table = "\n".join(lines[head:])
    assert "opt.step()" in table and "I/O-busy" in table and "wall:" in table
    assert " 0.00 " not in table  # small figures get smaller units, not zeros
    rows = [ln.split() for ln in table.splitlines()[1:3]]
    assert all(r[-1] == "—" for r in rows)  # a host-only run did no NVMe I/O: no overlap
