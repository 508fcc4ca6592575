"""The Grain loader is seeded, resumable from its saved state, and shards by process."""

import json

import numpy as np
import pytest

from stagelm.data.loader import PackedRows, batch_iterator
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import read_json, write_json


def take(it, n):
    return [next(it)["tokens"].copy() for _ in range(n)]


def test_same_seed_same_batches_other_seed_other_order(micro_data):
    rows = PackedRows(micro_data / "packed/train")
    a, b = take(batch_iterator(rows, 4, 7), 30), take(batch_iterator(rows, 4, 7), 30)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    c = take(batch_iterator(rows, 4, 8), 30)
    assert not all((x == y).all() for x, y in zip(a, c, strict=True))
    assert a[0].shape == (4, 65)


def test_restored_iterator_continues_exactly(micro_data):
    rows = PackedRows(micro_data / "packed/train")
    it = batch_iterator(rows, 4, 3)
    take(it, 11)
    state = json.loads(json.dumps(it.get_state()))  # it must survive JSON (it is checkpointed as JSON)
    rest = take(it, 40)  # crosses an epoch boundary: 40 * 4 rows > the split
    resumed = batch_iterator(rows, 4, 3)
    resumed.set_state(state)
    assert all((x == y).all() for x, y in zip(rest, take(resumed, 40), strict=True))


def test_process_shards_are_disjoint_and_cover_the_split(micro_data):
    rows = PackedRows(micro_data / "packed/val")
    seen = []
    for index in range(2):
        it = batch_iterator(rows, 1, 0, shard_index=index, shard_count=2, shuffle=False, num_epochs=1)
        seen.append({row["tokens"][0].tobytes() for row in it})
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == len({r.tobytes() for r in rows.all_rows()["tokens"]})


def test_process_shares_make_up_the_single_process_batches(micro_data):
    rows = PackedRows(micro_data / "packed/val")
    whole = batch_iterator(rows, 4, 5)
    shares = [batch_iterator(rows, 2, 5, shard_index=i, shard_count=2) for i in range(2)]
    for _ in range(3 * len(rows) // 4):  # three epochs, each in a new order
        want = sorted(r.tobytes() for r in next(whole)["tokens"])
        got = sorted(r.tobytes() for it in shares for r in next(it)["tokens"])
        assert got == want
    assert shares[0].get_state() == shares[1].get_state() == whole.get_state()


def test_corrupt_shard_is_named(micro_data, tmp_path):
    import shutil

    split = tmp_path / "train"
    shutil.copytree(micro_data / "packed/train", split)
    shard = split / read_json(split / "manifest.json")["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(StagelmError, match=f"^{shard}: sha256 differs from manifest.json"):
        PackedRows(split)
    manifest = read_json(split / "manifest.json")
    manifest["schema_version"] = 99
    write_json(split / "manifest.json", manifest)
    with pytest.raises(StagelmError, match="schema_version 99"):
        PackedRows(split)


def test_epochs_reshuffle(micro_data):
    rows = PackedRows(micro_data / "packed/val")
    n = len(rows)
    it = batch_iterator(rows, 1, 0)
    first, second = [next(it)["tokens"][0] for _ in range(n)], [next(it)["tokens"][0] for _ in range(n)]
    assert sorted(x.tobytes() for x in first) == sorted(x.tobytes() for x in second)
    assert n >= 3
    assert not all((x == y).all() for x, y in zip(first, second, strict=True))
    assert np.stack(first).shape == (n, 65)
