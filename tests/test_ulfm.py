"""Fault tolerance under ULFM (``cluster.fault_tolerance = "ulfm"``): real jobs of Open MPI's wheel,
launched from the second environment ``.venv-ft`` (``make install-ft``; ``make test`` makes it) with
``mpiexec --with-ft ulfm``, one of whose ranks is killed with kill -9 mid-run.

* A worker killed: the job goes on and ends with exit status 0, and every row of the data is
  trained exactly once. The data says so exactly: each row has a feature of its own, and FTRL with
  an L1 far above any gradient keeps every weight at zero, so that each row's gradient is
  ``0.5 - label`` whatever the order of the steps; a row's FTRL state ``n`` (its summed squared
  gradients) is then 0.25 after one training, 0.5 after two, and its key is missing after none.
* A server killed (no replicas): one line naming it, exit status 1, and no rank left waiting.
* A server killed with ``cluster.replicas = 1`` (2 servers, 2 workers, BSP): the survivor's copies
  are promoted, the job ends with exit status 0 (no rank crashed at its end), the summary names
  the server lost and the clock, and its model is bit-identical to the same job's without the
  kill (the data's rows share keys, so every step reads what the others pushed). The stall of
  training after the kill is printed (``-s``): the longest the first worker's step stood still
  from the kill to the end. Twice: LR (one table), and wide & deep with 16-bit values on the
  wire (its two sparse tables' rows asked again in one request, read in the wire's type).
* A server lost once serving is done (it kills itself there: ``HPCPS_TEST_KILL``), where no
  worker's request meets the loss: with a replica its shards are promoted at the end (exit status
  0, the summary's "server lost", every key in the model and its count); without, one line and
  exit status 1 (no model missing its rows). Also killed in the end's sums, after the agreement on
  the servers lost: the sums are done again once it is failed over.
* Three servers with ``cluster.replicas = 1`` (2 workers, BSP): server 1 killed, the new backups
  of its shards copied over the wire between the two survivors (each copies to the other), then
  server 2 killed once both copies landed, so that the last server goes on from its copies: exit
  status 0, the model and the last checkpoint bit-identical to the job's without the kills.
* Servers 1 and 2 killed together (3 servers, 1 replica): the shards whose copies were on both
  have none left (a copy awaited from a lost server counted as one): one line, exit status 1.
  The job had gone on, or waited for the copy, and hung past the test's 240 s.
* The same under ASP (``cluster.staleness = -1``) and SSP (``2``), server 1 killed: the copies are
  cut at the workers' notices of the new placement, each source sending a shadow of the moved
  rows given only the pushes sent before their worker's notice (its rows get every push). Exit
  status 0, and every push applied exactly once on every copy: with FTRL's L1 far above
  any gradient every weight stays zero, so each push is ``0.5 - label`` summed over its batch's
  rows whatever the order, and sums of halves are exact in float32; each key's ``z`` must then be
  its rows' sum of ``0.5 - label`` (the data says it), and every backup's rows, ``n`` included,
  bit-identical to its primary's (the end of serving's digests).
* A rank lost before MPI start-up finished (it kills itself there: ``HPCPS_TEST_KILL``): the
  others waited in Open MPI's start-up for ever; now they end after
  ``HPCPS_TUNE_MPI_START_UP_TIMEOUT_S`` with a line naming it, exit status 1.
* ``"ulfm"`` under MPICH (the main environment): one line at start-up, exit status 2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hpcps.ps import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402
from test_checkpoint import rank_pids  # noqa: E402
from test_faults import wait_for  # noqa: E402

FT = os.environ.get("HPCPS_FT_VENV", os.path.join(ROOT, ".venv-ft"))
ROWS, BATCH, KILL_AT_STEP = 3_000, 10, 20
TIMEOUT = 240


@pytest.fixture(scope="module")
def ft_launcher() -> list[str]:
    """``mpiexec --with-ft ulfm`` of .venv-ft (as root, as CI runs, with Open MPI's consent)."""
    failed = os.path.join(FT, ".install-failed")
    if os.path.exists(failed):
        pytest.skip(f"Open MPI's wheel did not install into {FT}: {open(failed).read().strip()}")
    if not os.path.exists(os.path.join(FT, "bin", "mpiexec")):
        pytest.skip(f"no {FT}: make install-ft (make test makes it) sets up Open MPI's environment")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [os.path.join(FT, "bin", "mpiexec"), *root, "--oversubscribe", "--with-ft", "ulfm"]


@pytest.fixture(scope="module")
def one_key_a_row(tmp_path_factory) -> str:
    """ROWS rows, each with a feature of its own (key i + 1) and a random label."""
    path = tmp_path_factory.mktemp("ulfm") / "rows.svm"
    labels = np.random.default_rng(40).integers(0, 2, ROWS)
    path.write_text("".join(f"{y} {i + 1}:1\n" for i, y in enumerate(labels)))
    return str(path)


@pytest.fixture(scope="module")
def shared_keys(tmp_path_factory) -> str:
    """ROWS rows of up to 5 features among 400 keys (Zipf: a few in most rows), random labels."""
    path = tmp_path_factory.mktemp("ulfm") / "shared.svm"
    rng = np.random.default_rng(40)
    path.write_text("".join(f"{rng.integers(0, 2)} " + " ".join(f"{k}:1" for k in np.unique(rng.zipf(1.3, 5) % 400 + 1))
                            + "\n" for _ in range(ROWS)))
    return str(path)


def args(data: str, ck, servers: int, **more) -> list[str]:
    sets = {"data.train": json.dumps(data), "train.batch_size": BATCH, "train.epochs": 1, "train.progress": "false",
            "cluster.servers": servers, "cluster.fault_tolerance": '"ulfm"', "optimizer.name": '"ftrl"',
            "optimizer.l1": 1e9, "model.bias_init": '"zero"', "checkpoint.dir": json.dumps(str(ck)), **more}
    return ["train"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def at_the_kill(status, ck, ranks: int) -> bool:
    """Whether the job's first worker has done KILL_AT_STEP steps (its status file) and all its
    ``ranks`` are up (their PIDs known)."""
    try:
        step = json.loads(status.read_text()).get("global_step", 0)
    except (OSError, ValueError):
        step = 0
    return step >= KILL_AT_STEP and len(rank_pids(str(ck), "OMPI_COMM_WORLD_RANK")) == ranks


def kill_mid_run(launcher: list[str], data: str, tmp_path, ranks: int, servers: int, victim: int,
                 more: dict | None = None, stalls: list | None = None, flags: tuple = ()) -> tuple:
    """Start the job (``flags``: more of its command line); once its first worker has done
    KILL_AT_STEP steps, kill -9 rank ``victim``.
    Returns (exit status, output, seconds from the kill to the job's end); ``stalls`` gets the
    longest time the first worker's step stood still after the kill (:func:`longest_stall`)."""
    ck, status = tmp_path / "ck", tmp_path / "status.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HPCPS_STATUS_FILE=str(status), HPCPS_TUNE_STATUS_EVERY_S="0")
    proc = subprocess.Popen([*launcher, "-n", str(ranks), os.path.join(FT, "bin", "python"), "-m", "hpcps.cli",
                             *args(data, ck, servers, **(more or {})), *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=str(tmp_path), start_new_session=True)
    try:
        reached = wait_for(lambda: at_the_kill(status, ck, ranks), TIMEOUT, proc)
        assert proc.poll() is None, f"the job ended before the kill:\n{proc.stdout.read()[-3000:]}"
        assert reached, "the job never reached the step of the kill"
        pids = rank_pids(str(ck), "OMPI_COMM_WORLD_RANK")
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.monotonic()
        if stalls is not None:
            stalls.append(longest_stall(status, proc, killed))
        out, _ = proc.communicate(timeout=TIMEOUT)
        return proc.returncode, out, time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def longest_stall(status, proc, since: float) -> float:
    """The longest time the status file's step stood still (it is written at every step) from
    ``since`` until the job's end: the stall of training after a kill."""
    longest, last, moved = 0.0, None, since
    while proc.poll() is None and time.monotonic() < since + TIMEOUT:
        try:
            step = json.loads(status.read_text()).get("global_step", 0)
        except (OSError, ValueError):
            step = last
        now = time.monotonic()
        if step != last:
            longest, last, moved = max(longest, now - moved), step, now
        time.sleep(0.005)
    return longest


def model_rows(path) -> dict:
    """A model file's tables as {name: (keys sorted, their rows)} (the servers' order apart)."""
    import h5py
    out = {}
    with h5py.File(path, "r") as f:
        for name, g in f["tables"].items():
            keys = g["keys"][...]
            order = np.argsort(keys)
            out[name] = (keys[order], g["values"][...][order])
    return out


def checkpoint_rows(ck) -> dict:
    """The newest good checkpoint's tables as {name: (keys sorted, their rows)}; a key held twice
    fails (a shard written by two servers)."""
    newest, manifest = checkpoint.newest_good(str(ck))
    out = {}
    for table in manifest["tables"]:
        keys, rows = checkpoint.read_shards(newest, manifest, table["name"],
                                            np.ones(manifest["layout"]["num_shards"], bool))
        order = np.argsort(keys)
        assert np.unique(keys).shape == keys.shape, f"table {table['name']}: keys written twice"
        out[table["name"]] = (keys[order], rows[order])
    return out


def test_a_worker_killed_mid_run_the_others_train_its_rows_each_row_exactly_once(ft_launcher, one_key_a_row,
                                                                                   tmp_path):
    # 1 server and 3 workers: 1,000 rows and 100 steps each; worker 1 (rank 2) killed after step 20
    rc, out, _ = kill_mid_run(ft_launcher, one_key_a_row, tmp_path, ranks=4, servers=1, victim=2)
    assert rc == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    said = [ln for ln in out.splitlines() if "lost after clock" in ln]
    assert len(said) == 1 and said[0].startswith("hpcps train: worker 1 lost after clock "), out[-4000:]
    assert "trained by the 2 workers left" in said[0]
    newest, manifest = checkpoint.newest_good(str(tmp_path / "ck"))
    keys, rows = checkpoint.read_shards(newest, manifest, "w", np.ones(manifest["layout"]["num_shards"], bool))
    n = dict(zip(keys.tolist(), rows[:, 2].tolist()))  # FTRL's [w | z | n]
    assert set(range(1, ROWS + 1)) <= set(n), "rows never trained"
    twice = [k for k in range(1, ROWS + 1) if n[k] != 0.25]
    assert not twice, f"rows trained more than once: {twice[:10]} (n = {[n[k] for k in twice[:10]]})"
    assert (rows[:, 0] == 0).all()  # (every weight stayed zero: the gradients were 0.5 - label)


def test_a_server_killed_without_replicas_ends_the_job_in_one_line(ft_launcher, one_key_a_row, tmp_path):
    rc, out, after_kill = kill_mid_run(ft_launcher, one_key_a_row, tmp_path, ranks=4, servers=2, victim=1)
    assert rc == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    said = [ln for ln in out.splitlines() if ln.startswith("hpcps: ")]
    assert len(said) == 1, out[-4000:]
    assert "server 1 (rank 1) was lost" in said[0] and "hpcps supervise restarts" in said[0], said
    assert after_kill < 60, after_kill  # (ended by the ranks left, not by a stall timeout)


def test_a_rank_lost_in_mpi_start_up_ends_the_others_after_the_start_up_timeout(ft_launcher, tmp_path):
    # rank 1 kills itself before MPI has started: ranks 0 and 2 waited in PMIx_Get for good
    env = dict(os.environ, HPCPS_TEST_KILL="start-up:1", HPCPS_TUNE_MPI_START_UP_TIMEOUT_S="3")
    began = time.monotonic()
    proc = subprocess.run([*ft_launcher, "-n", "3", os.path.join(FT, "bin", "python"), "-m", "hpcps.cli", "train",
                           "--set", 'cluster.fault_tolerance="ulfm"', "--set", "synth.rows=100"],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and time.monotonic() - began < 60, out[-3000:]
    said = [ln for ln in out.splitlines() if ln.startswith("hpcps: ")]
    assert said and all("MPI start-up did not finish within 3 s" in ln and "HPCPS_TUNE_MPI_START_UP_TIMEOUT_S" in ln
                        for ln in said), out[-3000:]
    assert "Timeout (" not in out and "Traceback" not in out, out[-3000:]  # (faulthandler's dump kept off)


def test_ulfm_under_an_mpi_without_it_is_one_line_at_start_up(tmp_path):
    proc = subprocess.run([*mpiexec(), "-n", "2", sys.executable, "-m", "hpcps.cli", "train",
                           "--set", 'cluster.fault_tolerance="ulfm"', "--set", "synth.rows=100"],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    lines = [ln for ln in out.splitlines() if "fault_tolerance" in ln]
    assert len(lines) == 1 and "has no ULFM" in lines[0] and "--with-ft ulfm" in lines[0], out[-3000:]


@pytest.mark.parametrize("replicas, point", [(1, "served"), (0, "served"), (1, "summing")],
                         ids=["promoted", "no-copy", "during-the-sums"])
def test_a_server_lost_after_serving_is_failed_over_or_ends_the_job_never_drops_its_rows(ft_launcher, shared_keys,
                                                                                        tmp_path, replicas, point):
    # server 1 (rank 1) kills itself once its serving is done (HPCPS_TEST_KILL), every reply it
    # owed sent: no worker's request meets its loss, only the end's collectives (which shrank to
    # the survivors). The job exited 0 with the survivor's primary shards alone: half the model's
    # rows and of its key count, 'the backups of 1024 of 1024 shards differ', no "server lost".
    # "summing": killed in the end's sums (after the servers lost were agreed on), which are
    # done again once it is failed over (the first sums' digests lacked its copies: no warning)
    more = {"cluster.replicas": replicas, "optimizer.l1": 0.5, "train.model_out": '"model.h5"'}
    summary = tmp_path / "summary.json"
    proc = subprocess.run([*ft_launcher, "-n", "4", os.path.join(FT, "bin", "python"), "-m", "hpcps.cli",
                           *args(shared_keys, tmp_path / "ck", 2, **more), "--summary-json", str(summary)],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=str(tmp_path),
                          env=dict(os.environ, HPCPS_TEST_KILL=f"{point}:1"))
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "Process received signal" not in out, out[-4000:]
    if not replicas:  # (its rows are nowhere else: one line, exit status 1, no model)
        said = [ln for ln in out.splitlines() if ln.startswith("hpcps: ")]
        assert proc.returncode == 1 and not (tmp_path / "model.h5").exists(), out[-4000:]
        assert len(said) == 1 and "server 1 (rank 1) was lost" in said[0] and "no copy left" in said[0], out[-4000:]
        return
    assert proc.returncode == 0 and "shards differ" not in out, out[-4000:]
    got = json.loads(summary.read_text())
    assert got["servers_lost"][0]["server"] == 1 and got["replica_shards_differing"] == 0, got
    # every key in the model and its count, each row the end of training's checkpoint's (both
    # servers wrote it before the loss)
    keys, rows = model_rows(tmp_path / "model.h5")["w"]
    ck_keys, ck_rows = checkpoint_rows(tmp_path / "ck")["w"]
    assert np.array_equal(keys, ck_keys) and got["table_keys"] == keys.shape[0] > 300, (got, keys.shape)
    assert rows.reshape(-1).tobytes() == np.ascontiguousarray(ck_rows[:, 0]).tobytes()


@pytest.mark.parametrize("model", [
    # lr: one table, whose lost rows are asked again as its own pulls; delta snapshots, committed
    # with the survivor's file alone after the loss, and the one the lost server did not write
    # given up at once (each waited for the lost server's file: the job stood still until
    # cluster.stall_timeout_s)
    {"checkpoint.delta_every_steps": 10, "cluster.stall_timeout_s": 60},
    {"model.type": '"wdl"', "filters.wire_dtype": '"fp16"'},  # two tables in one request, 16-bit values
], ids=["lr-deltas", "wdl-fp16"])
def test_a_server_killed_with_a_replica_its_copies_go_on_to_the_same_model(ft_launcher, shared_keys, tmp_path, model):
    # 2 servers with 1 replica (each holds every shard) and 2 workers under BSP, server 1 (rank 1)
    # killed after step 20; against the same job not killed
    more = {"cluster.replicas": 1, "optimizer.l1": 0.5, "train.model_out": '"model.h5"', **model}
    (tmp_path / "ref").mkdir()
    ref = subprocess.run([*ft_launcher, "-n", "4", os.path.join(FT, "bin", "python"), "-m", "hpcps.cli",
                          *args(shared_keys, tmp_path / "ref" / "ck", 2, **more)], capture_output=True, text=True,
                         timeout=TIMEOUT, cwd=str(tmp_path / "ref"))
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    stalls = []
    rc, out, _ = kill_mid_run(ft_launcher, shared_keys, tmp_path, ranks=4, servers=2, victim=1, more=more,
                              stalls=stalls)
    assert rc == 0, out[-4000:]
    assert "Traceback" not in out and "error:" not in out, out[-4000:]
    # (no rank crashed in MPI_Finalize: under ULFM mpiexec exits 0 even then; a collective the
    # ranks called in different orders after the loss corrupted memory that way)
    assert "Process received signal" not in out and "MPI Error in NBC subrequest" not in out, out[-4000:]
    said = [ln for ln in out.splitlines() if "server lost" in ln]
    assert len(said) == 1 and "server 1 at clock" in said[0], out[-4000:]
    if "checkpoint.delta_every_steps" in model:
        after = out[out.index("lost: its shards' backups are primary now"):]
        missed = [ln for ln in out.splitlines() if "delta snapshot" in ln and "not written" in ln]
        assert "hpcps train: delta snapshot" in after and "still waiting" not in out, out[-4000:]
        assert all("server 1 was lost before it wrote" in ln or "server 1 was lost while it was written" in ln
                   for ln in missed), missed
    got, want = model_rows(tmp_path / "model.h5"), model_rows(tmp_path / "ref" / "model.h5")
    assert got.keys() == want.keys() and max(len(keys) for keys, _ in want.values()) > 300
    for name in want:
        assert np.array_equal(got[name][0], want[name][0]), name
        assert got[name][1].tobytes() == want[name][1].tobytes(), f"table {name}: the rows differ"
    # the last checkpoint, written by the survivor alone: every key once, each row (optimizer state
    # included) as the uninterrupted run's checkpoint has it
    assert checkpoint_rows(tmp_path / "ck").keys() == checkpoint_rows(tmp_path / "ref" / "ck").keys()
    for name, (keys, rows) in checkpoint_rows(tmp_path / "ref" / "ck").items():
        got_keys, got_rows = checkpoint_rows(tmp_path / "ck")[name]
        assert np.array_equal(got_keys, keys) and got_rows.tobytes() == rows.tobytes(), f"checkpoint table {name}"
    print(f"\nstall of training after a server's kill -9: {stalls[0]:.3f} s")
    print("\n".join(ln for ln in out.splitlines() if "lost" in ln))


def kill_twice(launcher: list[str], data: str, tmp_path, ranks: int, servers: int, victims: tuple[int, int],
               more: dict, ready) -> tuple:
    """As :func:`kill_mid_run`, rank ``victims[0]`` killed at step KILL_AT_STEP, and then rank
    ``victims[1]`` once ``ready(output so far)`` holds. Returns (exit status, output)."""
    ck, status, log = tmp_path / "ck", tmp_path / "status.json", tmp_path / "out.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HPCPS_STATUS_FILE=str(status), HPCPS_TUNE_STATUS_EVERY_S="0")
    with open(log, "w") as out:
        proc = subprocess.Popen([*launcher, "-n", str(ranks), os.path.join(FT, "bin", "python"), "-m", "hpcps.cli",
                                 *args(data, ck, servers, **more)], stdout=out, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=str(tmp_path), start_new_session=True)
    try:
        reached = wait_for(lambda: at_the_kill(status, ck, ranks), TIMEOUT, proc)
        assert reached and proc.poll() is None, log.read_text()[-3000:]
        pids = rank_pids(str(ck), "OMPI_COMM_WORLD_RANK")
        os.kill(pids[victims[0]], signal.SIGKILL)
        assert wait_for(lambda: ready(log.read_text()), TIMEOUT, proc) and proc.poll() is None, log.read_text()[-3000:]
        os.kill(pids[victims[1]], signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
        return proc.returncode, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_three_servers_one_lost_new_backups_copied_then_a_second_lost_the_same_model(ft_launcher, shared_keys,
                                                                                    tmp_path):
    # 3 servers with 1 replica and 2 workers under BSP: server 1 (rank 1) killed after step 20, its
    # shards' new backups copied between servers 0 and 2 (each to the other), then server 2 (rank 2)
    # killed once they landed: server 0 alone goes on from its copies; against the job not killed
    more = {"cluster.replicas": 1, "optimizer.l1": 0.5, "train.model_out": '"model.h5"', "train.epochs": 2}
    (tmp_path / "ref").mkdir()
    ref = subprocess.run([*ft_launcher, "-n", "5", os.path.join(FT, "bin", "python"), "-m", "hpcps.cli",
                          *args(shared_keys, tmp_path / "ref" / "ck", 3, **more)], capture_output=True, text=True,
                         timeout=TIMEOUT, cwd=str(tmp_path / "ref"))
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    rc, out = kill_twice(ft_launcher, shared_keys, tmp_path, ranks=5, servers=3, victims=(1, 2), more=more,
                         ready=lambda text: text.count("new backups of") == 2)
    assert rc == 0, out[-4000:]
    assert "Traceback" not in out and "error:" not in out, out[-4000:]
    assert "Process received signal" not in out and "MPI Error in NBC subrequest" not in out, out[-4000:]
    landed = [ln for ln in out.splitlines() if "new backups of" in ln]
    assert sorted(ln.split(":")[1].strip() for ln in landed) == ["server 0", "server 2"], landed
    got, want = model_rows(tmp_path / "model.h5"), model_rows(tmp_path / "ref" / "model.h5")
    assert got.keys() == want.keys() and max(len(keys) for keys, _ in want.values()) > 300
    for name in want:
        assert np.array_equal(got[name][0], want[name][0]), name
        assert got[name][1].tobytes() == want[name][1].tobytes(), f"table {name}: the rows differ"
    for name, (keys, rows) in checkpoint_rows(tmp_path / "ref" / "ck").items():
        got_keys, got_rows = checkpoint_rows(tmp_path / "ck")[name]
        assert np.array_equal(got_keys, keys) and got_rows.tobytes() == rows.tobytes(), f"checkpoint table {name}"
    print("\n" + "\n".join(ln for ln in out.splitlines() if "lost" in ln or "landed" in ln))


def test_three_servers_two_lost_at_once_without_a_copy_end_the_job_in_one_line(ft_launcher, shared_keys, tmp_path):
    # servers 1 and 2 killed together: the shards whose copies were both on them have none left
    rc, out = kill_twice(ft_launcher, shared_keys, tmp_path, ranks=5, servers=3, victims=(1, 2),
                         more={"cluster.replicas": 1, "train.epochs": 2}, ready=lambda text: True)
    said = [ln for ln in out.splitlines() if ln.startswith("hpcps: ") and "error:" in ln]
    print("\n" + "\n".join(ln for ln in out.splitlines() if ln.startswith("hpcps")))
    assert rc == 1 and len(said) == 1 and "was lost" in said[0], out[-4000:]


@pytest.mark.parametrize("groups", [
    {},
    # one group of 2 whose first rank pushes and pulls for both: it tells the servers of the new
    # placement for its member too (who sends them nothing until its end), so the copies are
    # made while training goes on
    {"cluster.worker_groups": 1, "train.group_pull": "true"},
    # SSP (staleness 2): reads see every push meanwhile, the copies made from the sources' shadows
    {"cluster.staleness": 2},
], ids=["workers", "group-pull", "ssp"])
def test_three_servers_under_asp_or_ssp_one_lost_new_backups_get_every_push_exactly_once(ft_launcher, shared_keys,
                                                                                  tmp_path, groups):
    # 3 servers with 1 replica and 2 workers under ASP (or SSP): server 1 (rank 1) killed after step
    # 20, its shards' new backups copied between servers 0 and 2 while the workers push on
    more = {"cluster.replicas": 1, "cluster.staleness": -1, "train.epochs": 2, **groups}
    summary = tmp_path / "summary.json"
    rc, out, _ = kill_mid_run(ft_launcher, shared_keys, tmp_path, ranks=5, servers=3, victim=1, more=more,
                              flags=("--summary-json", str(summary)))
    assert rc == 0, out[-4000:]
    assert "Traceback" not in out and "error:" not in out, out[-4000:]
    assert "Process received signal" not in out and "MPI Error in NBC subrequest" not in out, out[-4000:]
    landed = [ln for ln in out.splitlines() if "new backups of" in ln]
    assert sorted(ln.split(":")[1].strip() for ln in landed) == ["server 0", "server 2"], out[-4000:]
    assert all("cut at the workers' notices" in ln for ln in landed), landed
    copied = [ln for ln in out.splitlines() if "as new backups" in ln]  # (the sources': from their shadows)
    assert len(copied) == 2 and all("applied to its shadow" in ln for ln in copied), copied
    lines = out.splitlines()
    ended = [i for i, ln in enumerate(lines) if "(end of training)" in ln]
    assert ended and max(i for i, ln in enumerate(lines) if "new backups of" in ln) < ended[0], out[-4000:]
    got = json.loads(summary.read_text())
    assert got["servers_lost"][0]["server"] == 1 and got["replica_shards_differing"] == 0, got
    # each key's z: its rows' sum of 0.5 - label over the 2 epochs, each push applied once
    want: dict[int, float] = {}
    for line in open(shared_keys):
        label, *feats = line.split()
        for f in feats:
            k = int(f.split(":")[0])
            want[k] = want.get(k, 0.0) + 2 * (0.5 - int(label))
    newest, manifest = checkpoint.newest_good(str(tmp_path / "ck"))
    keys, rows = checkpoint.read_shards(newest, manifest, "w", np.ones(manifest["layout"]["num_shards"], bool))
    z = dict(zip(keys.tolist(), rows[:, 1].tolist()))  # FTRL's [w | z | n]
    assert (rows[:, 0] == 0).all() and len(want) > 300
    wrong = {k: (z.get(k), v) for k, v in want.items() if z.get(k) != v}
    assert not wrong, f"{len(wrong)} keys' pushes not applied exactly once: {list(wrong.items())[:10]}"
    print("\n" + "\n".join(ln for ln in out.splitlines() if "lost" in ln or "backups" in ln))


def test_a_lost_rank_line_never_advises_what_the_job_has_on_already():
    """Under ULFM (and replicas) a loss that still ends the job (a worker group's gather, a server
    in a step not failed over) said 'cluster.fault_tolerance = "ulfm" goes on without a lost
    worker' and 'no replicas of its shards'."""
    from hpcps.ps.context import lost_rank_line
    from hpcps.ps.layout import Layout
    from hpcps.ps.transport import RankFailed

    layout = Layout.plan(4, 2)
    worker, server = RankFailed([2], "gather of push sizes"), RankFailed([1], "checkpoint reply")
    said = {(ulfm, r): (lost_rank_line(worker, layout, ulfm, r)[1], lost_rank_line(server, layout, ulfm, r)[1])
            for ulfm in (False, True) for r in (0, 1)}
    assert 'fault_tolerance = "ulfm" goes on without a lost worker' in said[False, 0][0]
    assert "no replicas of its shards" in said[False, 0][1] and "goes on with its shards' copies" in said[False, 1][1]
    for r in (0, 1):
        assert "ULFM's limits" in said[True, r][0] and "ulfm" not in said[True, r][0]
    assert "no replicas" in said[True, 0][1] and "not promoted in this step" in said[True, 1][1]
    assert all(line.startswith(("worker 0 (rank 2) was lost", "server 1 (rank 1) was lost"))
               for pair in said.values() for line in pair)
