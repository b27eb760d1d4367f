"""How a checkpoint's files get onto the disk (docs/CHECKPOINTS.md, "Writing"): a rank file is the
same bytes whichever way it is written (HDF5 building its structure the first time, the kept structure
and positioned writes after, the page-aligned snapshot image with direct I/O), it reads back as its
pieces with plain h5py, direct I/O falls back where a filesystem refuses it, the background writer runs
at the lowest CPU priority, snapshot buffers are reused, and pruning never exposes half a checkpoint."""

import errno
import os
import sys
import threading

import h5py
import numpy as np
import pytest

from boostmpi import checkpoint as ckpt
from boostmpi.checkpoint import layout, runs, writer
from boostmpi.config import load_config
from boostmpi.model.params import all_global_specs
from tests.support.train_helpers import TINY_CONFIG


def layout_config(tmp_path, *overrides):
    return load_config(TINY_CONFIG, overrides=[f"train.run_dir={tmp_path / 'run'}", *overrides])


def random_states(cfg, seed=0):
    """Every rank's RankState of `cfg`'s layout, cut from random global tensors and moments."""
    rng = np.random.default_rng(seed)
    tensors, m, v = ({s.name: rng.standard_normal(s.global_shape) for s in all_global_specs(cfg)} for _ in range(3))
    return ckpt.global_rank_states(cfg, tensors, (m, v))


def assert_rank_file_holds(path, cfg, state):
    """The file at `path` opens with plain h5py and holds `state`'s pieces under their names and boxes."""
    lo, _, pieces = ckpt.rank_pieces(cfg, *state.coords)
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "boostmpi"
        assert tuple(f.attrs["coords"]) == tuple(state.coords)
        for group, flat in (("model", state.params), ("m", state.m), ("v", state.v)):
            for p in pieces:
                ds = f[f"{group}/{p.key}"]
                assert [tuple(b) for b in ds.attrs["box"]] == [tuple(b) for b in p.box]
                np.testing.assert_array_equal(ds[()], p.take(flat, lo))


@pytest.mark.parametrize("settings", [("parallel.tp=1",), ("parallel.tp=2", "parallel.dp=2", "parallel.zero_stage=1"),
                                      ("parallel.pp=2", "parallel.dp=3")])
def test_a_rank_file_is_the_same_bytes_however_it_is_written(settings, tmp_path):
    cfg = layout_config(tmp_path, *settings)
    for state in random_states(cfg):
        first, kept, image_file = (tmp_path / f"{name}-{'-'.join(map(str, state.coords))}.h5"
                                   for name in ("first", "kept", "image"))
        layout._STRUCTURES.clear()
        ckpt.write_rank_file(str(first), cfg, state)  # HDF5 lays out the structure
        ckpt.write_rank_file(str(kept), cfg, state)  # the kept structure, positioned writes
        image, size = ckpt.rank_file_image(str(image_file), cfg, state)
        ckpt.write_file_image(str(image_file), image, size)
        assert len(image) % 4096 == 0 and size <= len(image) < size + 4096
        assert first.read_bytes() == kept.read_bytes() == image_file.read_bytes() == bytes(image[:size])
        assert_rank_file_holds(kept, cfg, state)


def test_new_values_are_written_over_the_kept_structure(tmp_path):
    cfg = layout_config(tmp_path, "parallel.tp=2")
    path = str(tmp_path / "rank.h5")
    for seed in (1, 2):
        state = random_states(cfg, seed)[1]
        ckpt.write_rank_file(path, cfg, state)
        assert_rank_file_holds(path, cfg, state)
        image, size = ckpt.rank_file_image(path, cfg, state)  # a spare buffer of the previous round, refilled
        ckpt.write_file_image(path, image, size)
        ckpt.SPARE_IMAGES.give_back(image)
        assert_rank_file_holds(path, cfg, state)


def test_a_snapshot_buffer_is_reused_by_the_next_save(tmp_path):
    cfg = layout_config(tmp_path)
    state = random_states(cfg)[0]
    path = str(tmp_path / "rank.h5")
    image, _ = ckpt.rank_file_image(path, cfg, state)
    ckpt.SPARE_IMAGES.give_back(image)
    again, _ = ckpt.rank_file_image(path, cfg, state)
    assert again is image
    ckpt.SPARE_IMAGES.give_back(again)


def test_direct_io_falls_back_to_buffered_writes_where_the_filesystem_refuses_it(tmp_path, monkeypatch):
    cfg = layout_config(tmp_path)
    state = random_states(cfg)[0]
    path = str(tmp_path / "rank.h5")
    image, size = ckpt.rank_file_image(path, cfg, state)
    real_open, direct_asked = os.open, []

    def open_without_direct_io(name, flags, *args):  # what tmpfs answers
        if flags & getattr(os, "O_DIRECT", 0):
            direct_asked.append(name)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), name)
        return real_open(name, flags, *args)

    monkeypatch.setattr(os, "open", open_without_direct_io)
    ckpt.write_file_image(path, image, size)
    monkeypatch.undo()
    assert direct_asked == ([path] if hasattr(os, "O_DIRECT") else [])
    assert os.path.getsize(path) == size
    assert_rank_file_holds(path, cfg, state)


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
def test_a_snapshot_is_written_on_tmpfs_which_has_no_direct_io(tmp_path):
    import tempfile

    cfg = layout_config(tmp_path)
    state = random_states(cfg)[0]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        path = os.path.join(folder, "rank.h5")
        image, size = ckpt.rank_file_image(path, cfg, state)
        ckpt.write_file_image(path, image, size)
        assert_rank_file_holds(path, cfg, state)


def test_an_error_other_than_no_direct_io_is_raised(tmp_path, monkeypatch):
    cfg = layout_config(tmp_path)
    state = random_states(cfg)[0]
    path = str(tmp_path / "rank.h5")
    image, size = ckpt.rank_file_image(path, cfg, state)

    def disk_full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer, "write_at", disk_full)
    with pytest.raises(OSError) as caught:
        ckpt.write_file_image(path, image, size)
    assert caught.value.errno == errno.ENOSPC


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_the_background_writer_runs_at_the_lowest_cpu_priority_and_leaves_the_caller_alone(tmp_path, monkeypatch):
    cfg = layout_config(tmp_path)
    state = random_states(cfg)[0]
    pending = ckpt.PendingSave(cfg.train.run_dir, 1, cfg, [state], 0, {"data": {}})
    pending.snapshot()
    seen = []
    real_write = writer.write_file_image

    def write_and_look(*args):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        real_write(*args)

    monkeypatch.setattr(writer, "write_file_image", write_and_look)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=pending.write_in_background)
    thread.start()
    thread.join()
    assert seen == [19]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    folder = pending.finish()
    ckpt.verify(folder)
    assert_rank_file_holds(os.path.join(folder, ckpt.rank_file_name(0, 0, 0)), cfg, state)


def test_a_snapshot_is_taken_so_training_may_change_its_arrays(tmp_path):
    """After `snapshot`, the arrays handed to the save can change: the checkpoint holds their values at
    the snapshot."""
    cfg = layout_config(tmp_path)
    state = random_states(cfg)[0]
    kept = ckpt.RankState(state.coords, state.base, state.params.copy(), state.m.copy(), state.v.copy())
    pending = ckpt.PendingSave(cfg.train.run_dir, 1, cfg, [state], 0, {"data": {}})
    pending.snapshot()
    for a in (state.params, state.m, state.v):
        a += 1.0
    pending.write_in_background()
    folder = pending.finish()
    assert_rank_file_holds(os.path.join(folder, ckpt.rank_file_name(0, 0, 0)), cfg, kept)


def test_pruning_in_the_background_never_shows_half_a_checkpoint(tmp_path, monkeypatch):
    cfg = layout_config(tmp_path)
    run_dir = cfg.train.run_dir
    root = os.path.join(run_dir, "checkpoints")
    deleting = threading.Event()
    release = threading.Event()
    real_rmtree = runs.shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):  # the deleting thread waits here until the test has looked
        if os.path.basename(path).endswith(".tmp-pruned") and threading.current_thread().name == "boostmpi-prune":
            deleting.set()
            release.wait(timeout=30)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(runs.shutil, "rmtree", slow_rmtree)
    for step in (1, 2):
        ckpt.save(run_dir, step, cfg, random_states(cfg, step), 0, {"data": {}}, keep=1, prune_in_background=True)
    assert deleting.wait(timeout=30)
    # step 1 is gone from view at once (renamed in one step), while its bytes are still being deleted
    assert sorted(os.listdir(root)) == [".step_00000001.tmp-pruned", "latest", "step_00000002"]
    assert [os.path.basename(p) for p in ckpt.complete_checkpoints(run_dir)] == ["step_00000002"]
    assert ckpt.stale_temporaries(run_dir) == [os.path.join(root, ".step_00000001.tmp-pruned")]
    release.set()
    ckpt.wait_for_pruning()
    assert sorted(os.listdir(root)) == ["latest", "step_00000002"]
    ckpt.verify(os.path.join(root, "step_00000002"))


def test_a_checkpoint_of_an_earlier_version_recording_sha256_is_still_verified(tmp_path):
    import hashlib
    import json

    from boostmpi.errors import CheckpointError

    cfg = layout_config(tmp_path)
    folder = ckpt.save(cfg.train.run_dir, 1, cfg, random_states(cfg), 0, {"data": {}})
    marker_path = os.path.join(folder, ckpt.MARKER)
    with open(marker_path) as f:
        marker = json.load(f)
    assert all(set(record) == {"bytes", "xxh3_64"} for record in marker.values())
    earlier = {name: {"bytes": record["bytes"],
                      "sha256": hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()}
               for name, record in marker.items()}
    with open(marker_path, "w") as f:
        json.dump(earlier, f)
    ckpt.verify(folder)
    rank_file = os.path.join(folder, ckpt.rank_file_name(0, 0, 0))
    with open(rank_file, "r+b") as f:  # one byte of tensor data altered, the size kept
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="is corrupted: its SHA-256 does not match"):
        ckpt.verify(folder)
    del earlier["state.json"]["sha256"]
    with open(marker_path, "w") as f:
        json.dump(earlier, f)
    with pytest.raises(CheckpointError, match="records no checksum of state.json"):
        ckpt.verify(folder, files=["state.json"])


@pytest.mark.parametrize("staging", [4096, 3 * 4096 + 512])
def test_a_rank_file_goes_out_in_whole_staged_chunks_and_is_cut_to_its_size(staging, tmp_path, monkeypatch):
    """Small staging buffers: the file crosses many chunk boundaries (and, with a buffer not a whole number
    of pages, a padded direct write in the middle falls back to ordinary writes), and still equals the
    image byte for byte, with its checksum that of its bytes."""
    import xxhash

    monkeypatch.setattr(writer.SequentialWriter, "STAGING", staging)
    cfg = layout_config(tmp_path, "parallel.tp=2")
    state = random_states(cfg)[1]
    path = str(tmp_path / "rank.h5")
    digest = ckpt.Checksum()
    ckpt.write_rank_file(path, cfg, state, digest=digest)
    image, size = ckpt.rank_file_image(str(tmp_path / "image.h5"), cfg, state)
    data = open(path, "rb").read()
    assert data == bytes(image[:size]) and len(data) > 3 * staging
    assert digest.hexdigest() == xxhash.xxh3_64(data).hexdigest()


def test_a_file_size_limit_inside_the_last_pages_padding_falls_back_to_ordinary_writes(tmp_path, monkeypatch):
    """As the kernel does under `ulimit -f` (SIGXFSZ ignored): the padded direct write of the last pages is
    cut short at the limit, the next write fails with EFBIG; the chunk is written again the ordinary way
    and the file ends at its own size, not at the limit."""
    cfg = layout_config(tmp_path)
    state = random_states(cfg)[0]
    path = str(tmp_path / "rank.h5")
    size = ckpt.rank_file_image(str(tmp_path / "image.h5"), cfg, state)[1]
    if size % 4096 == 0:
        pytest.skip("this file ends on a page: no padding")
    limit = (size // 1024 + 1) * 1024  # ulimit -f counts KiB: past the end, inside the last page
    real_write_at, cut = writer.write_at, []

    def write_up_to_the_limit(fd, data, offset):
        n = len(memoryview(data).cast("B"))
        if offset + n > limit:
            if offset < limit:
                real_write_at(fd, memoryview(data).cast("B")[:limit - offset], offset)
            cut.append(offset)
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        return real_write_at(fd, data, offset)

    monkeypatch.setattr(writer, "write_at", write_up_to_the_limit)
    ckpt.write_rank_file(path, cfg, state)
    assert cut and os.path.getsize(path) == size < limit
    assert_rank_file_holds(path, cfg, state)


@pytest.mark.parametrize("dp", [2, 3, 5])
def test_the_three_uses_of_the_zero_split_agree(dp, tmp_path, monkeypatch):
    """ZeRO-1's optimizer slices (`DataParallel.ranges`), the elements each dp rank writes to a checkpoint
    (`layout.write_range`) and the part of the initial weights each dp rank draws (`Engine.init_params`,
    seen through the counts of its all-gather) are one split, `data_parallel.zero_slices`."""
    from types import SimpleNamespace

    from boostmpi.model.params import FlatBuffer, param_specs
    from boostmpi.parallel import data_parallel, engine

    cfg = layout_config(tmp_path)
    buffer = FlatBuffer(param_specs(cfg, 0, 0), np.float64)
    drawn = []

    class Recording:  # the all-gather the engine's dp replicas exchange their drawn parts with
        def __init__(self, comm):
            pass

        def allgather_pieces(self, host, counts):
            drawn.append(list(counts))

    monkeypatch.setattr(engine, "HostCollectives", Recording)
    grid = SimpleNamespace(dp_size=dp, coords=SimpleNamespace(dp=0), dp=SimpleNamespace(comm=None))
    engine.Engine.init_params(SimpleNamespace(grid=grid, master_buffer=lambda: buffer, adopt_master=lambda b: None), 0)
    for size in (buffer.size, 10, 7, 3):
        split = data_parallel.zero_slices(size, dp)
        assert split[0][0] == 0 and split[-1][1] == size
        assert all(hi == lo for (_, hi), (lo, _) in zip(split, split[1:]))
        sharded = data_parallel.DataParallel(None, 0, dp, 1, [], {}, size, np, np.float64)
        assert sharded.ranges == split
        assert [layout.write_range(size, dp, r) for r in range(dp)] == split
    assert drawn == [[hi - lo for lo, hi in data_parallel.zero_slices(buffer.size, dp)]]
