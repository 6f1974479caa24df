"""tools/kernel_lab/deal_balance.py: the greedy deal on hand-made items, the launch's order of items in
KV-head sections, the items' costs on a step small enough to count by hand, and a run writing
its JSON."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from bench_scripts import LAB, load_script


@pytest.fixture(scope="module")
def script():
    return load_script("deal_balance", LAB)


def test_greedy_gives_each_item_to_the_program_free_first(script):
    assert script.greedy([4, 3, 2, 1], 2) == 5
    assert script.greedy([3, 3, 2, 2, 2], 2) == 7
    assert script.greedy([7, 1, 1, 1], 3) == 7


def test_sections_repeat_the_tiles_per_kv_head_group(script):
    # 16 query heads over 8 KV heads: a KV head's 2 query heads together
    tiles = torch.tensor([3.0, 2.0])
    one = script.in_sections(tiles, 1).tolist()
    assert one == ([3.0] * 2 + [2.0] * 2) * 8
    assert script.in_sections(tiles, 8).tolist() == [3.0] * 16 + [2.0] * 16  # the schedule's order
    assert script.in_sections(tiles, 4).tolist() == ([3.0] * 8 + [2.0] * 8) * 2


def test_tile_costs_count_walked_key_tiles_heaviest_first(script):
    # S0 at 1/64: one causal sequence of 512 tokens, 128-query and 128-key tiles at d128:
    # query tile i walks i + 1 key tiles, plus the per-item cost
    tiles, keys = script.tile_costs("S0", 128, item_cost=2, scale=64)
    assert tiles.tolist() == [6.0, 5.0, 4.0, 3.0] and keys == 512


def test_balance_reports_both_orders(script):
    got = script.balance(torch.tensor([4.0, 3, 2, 1]), 1, 2)
    assert got["items"] == 64 and got["kv_heads_per_section"] == 1
    assert got["greedy_over_perfect"] == 1.0 and got["schedule_order_over_perfect"] == 1.0


def test_halves_split_the_last_items_walks_and_jitter_is_seeded(script):
    # the last two items' walks (5 and 2 key tiles past the item cost of 2) in halves, each
    # half paying the item cost and the merge
    assert script.with_halves([9.0, 7.0, 4.0], 2, 2.0, 0.5) == [9.0, 5.5, 4.5, 3.5, 3.5]
    got = script.balance(torch.tensor([4.0, 3, 2, 1]), 1, 8, halve=True, trials=5)
    assert got["halved_items"] == 4  # 64 items on 8 programs (8 a program): half a round
    again = script.balance(torch.tensor([4.0, 3, 2, 1]), 1, 8, halve=True, trials=5)
    assert got == again and got["jittered_over_perfect"] > 1.0 and got["halved_over_perfect"] > 1.0


def test_run_writes_its_json(script, monkeypatch, tmp_path):
    argv = ["deal_balance.py", "--out", str(tmp_path), "--cases", "S0-128,S4-128", "--scale", "64"]
    argv += ["--sms", "4", "--l2-mb", "0.25"]
    monkeypatch.setattr(sys, "argv", argv)
    script.main()
    (path,) = tmp_path.glob("*-deal-balance-cpu.json")
    got = json.loads(path.read_text())
    assert set(got["cases"]) == {"S0-128", "S4-128"} and got["sms"] == 4 and got["trials"] == 40
    s0 = got["cases"]["S0-128"]
    # 512 keys x 2 (K and V) x 128 x 2 bytes = 256 KiB per KV head: one per section
    assert s0["items"] == 64 and s0["kv_heads_per_section"] == 1 and s0["greedy_over_perfect"] >= 1.0
