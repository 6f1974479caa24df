"""tools/kernel_lab/walk_waste.py: FA4's walked and allowed pairs on steps small enough to count by
hand, ours on the causal step both kernels tile alike, and a run writing its JSON."""

from __future__ import annotations

import json
import sys

import pytest
from bench_scripts import LAB, load_script

import spanattn as sa


@pytest.fixture(scope="module")
def script():
    return load_script("walk_waste", LAB)


def test_fa4_walks_from_the_first_rows_first_key_to_the_last_rows_last(script):
    # 256 causal queries over their own keys, window 100, d256 (64-key tiles with a window):
    # rows 0-127 walk key tiles 0-1 (keys 0-127), rows 128-255 tiles 0-3 (first key 29, last 255)
    got = script.fa4_twin([(256, 256)], 100, 256)
    allowed = sum(r + 1 for r in range(100)) + 156 * 100
    assert got == {"allowed": allowed, "walked": (2 + 4) * 128 * 64}
    # no window, 80-key tiles: rows 0-127 end at key 127 (tiles 0-1), rows 128-255 at 255 (0-3)
    assert script.fa4_twin([(256, 256)], None, 256) == {"allowed": 256 * 257 // 2, "walked": 6 * 128 * 80}


def test_fa4_chunks_see_their_cached_keys_and_last_tiles_count_whole(script):
    # a 130-query chunk after 70 cached keys, d128: rows 0-127 end at key 197 (tiles 0-1), rows
    # 128-129 (one tile of 128 rows, 2 of them real) at 199 (tiles 0-1)
    got = script.fa4_twin([(130, 200)], None, 128)
    assert got == {"allowed": sum(70 + r + 1 for r in range(130)), "walked": 4 * 128 * 128}


def test_ours_on_a_causal_step_walks_what_fa4_walks_at_d128(script):
    # 512 causal tokens in 128 x 128 tiles: query tile i walks i + 1 key tiles in both kernels
    got = script.ours(sa.Batch([sa.Seq(q_len=512)]), sa.LayerMask(), 128)
    want = {"allowed": 512 * 513 // 2, "walked": 10 * 128 * 128, "key_tiles_per_query_tile": 2.5}
    # each half of a tile ends on the diagonal tile and starts at key 0: nothing to trim
    assert got == want | {"walked_by_own_rows": 20 * 64 * 128}
    assert script.fa4_twin([(512, 512)], None, 128) == {"allowed": 512 * 513 // 2, "walked": 10 * 128 * 128}


def test_run_writes_its_json_and_refuses_head_dims_fa4_lacks(script, monkeypatch, tmp_path):
    argv = ["walk_waste.py", "--out", str(tmp_path), "--cases", "S0-128,S4-128", "--scale", "64"]
    monkeypatch.setattr(sys, "argv", argv)
    script.main()
    (path,) = tmp_path.glob("*-walk-waste-cpu.json")
    got = json.loads(path.read_text())
    assert set(got["cases"]) == {"S0-128", "S4-128"}
    assert got["cases"]["S0-128"]["waste_only_efficiency"] == 1.0  # S0 at 1/64: the step above
    monkeypatch.setattr(sys, "argv", ["walk_waste.py", "--out", str(tmp_path), "--cases", "S5-512"])
    with pytest.raises(SystemExit):
        script.main()


def test_consumers_walking_their_own_rows_skip_the_window_edges_tiles(script):
    # window 256 in 128-row tiles of 64 keys (d256): from the third query tile on, the tile walks
    # 6 key tiles, its first half ending a tile before the last, its second half starting a
    # tile after the first (5 each); tiles 0 / 1 walk 2 / 4, their halves 1 + 2 / 3 + 4
    layer = sa.LayerMask(window=256)
    plan = sa.plan(sa.Batch([sa.Seq(q_len=1024)]), layer, "cpu")
    assert script.consumer_tiles(plan, 128, 64) == 3 + 7 + 6 * 10
    got = script.ours(sa.Batch([sa.Seq(q_len=1024)]), layer, 256)
    assert got["walked"] == (2 + 4 + 6 * 6) * 128 * 64 and got["walked_by_own_rows"] == 70 * 64 * 64
    # 960 tokens: the last tile's second half holds no query and walks its last row's keys
    # (704-959: tiles 11-14), the first half tiles 10-14 (keys 641-959)
    plan = sa.plan(sa.Batch([sa.Seq(q_len=960)]), layer, "cpu")
    assert script.consumer_tiles(plan, 128, 64) == 3 + 7 + 5 * 10 + 5 + 4
