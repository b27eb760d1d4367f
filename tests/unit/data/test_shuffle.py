"""The shuffled training stream: each epoch a seeded permutation of every window, the same global
stream for any data-parallel size, and exactly resumable."""

import numpy as np

from boostmpi.data.shards import TrainLoader, write_shard

T, B = 4, 3


def _shards(tmp_path):
    paths = []
    for i, n in enumerate((4 * 7 + 1, 4 * 5 + 1)):  # 7 and 5 windows
        path = tmp_path / f"s{i}.bin"
        write_shard(path, np.arange(1000 * i, 1000 * i + n) % 60000)
        paths.append(str(path))
    return paths


def _windows(loader, batches):
    return [tuple(row) for _ in range(batches) for row in loader.next_batch()[0]]


def test_an_epoch_visits_every_window_once_in_a_seeded_order(tmp_path):
    paths = _shards(tmp_path)
    plain = _windows(TrainLoader(paths, T, 12, shuffle=False), 1)
    shuffled = _windows(TrainLoader(paths, T, 12, seed=1, shuffle=True), 1)
    assert sorted(shuffled) == sorted(plain) and shuffled != plain
    assert _windows(TrainLoader(paths, T, 12, seed=1, shuffle=True), 1) == shuffled
    assert _windows(TrainLoader(paths, T, 12, seed=2, shuffle=True), 1) != shuffled
    second = TrainLoader(paths, T, 12, seed=1, shuffle=True)
    second.next_batch()
    assert _windows(second, 1) != shuffled  # a new order for the next epoch


def test_dp_ranks_split_the_same_global_stream(tmp_path):
    paths = _shards(tmp_path)
    one = _windows(TrainLoader(paths, T, 2 * B, seed=5, shuffle=True), 4)
    ranks = [TrainLoader(paths, T, B, rank=r, world=2, seed=5, shuffle=True) for r in range(2)]
    two = []
    for _ in range(4):
        for loader in ranks:
            two.extend(tuple(row) for row in loader.next_batch()[0])
    assert two == one


def test_resume_continues_the_stream_exactly(tmp_path):
    paths = _shards(tmp_path)
    straight = TrainLoader(paths, T, B, seed=3, shuffle=True)
    expected = _windows(straight, 9)
    first = TrainLoader(paths, T, B, seed=3, shuffle=True)
    head = _windows(first, 5)
    resumed = TrainLoader(paths, T, B, seed=3, shuffle=True)
    resumed.load_state_dict(first.state_dict())
    assert head + _windows(resumed, 4) == expected
