"""benchmarks/deal_balance.py: the deal of gluon_parts.work_item and the greedy deal on hand-made
items, the items' costs on a step small enough to count by hand, and a run writing its JSON."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from bench_scripts import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("deal_balance")


def test_the_deal_turns_back_every_other_round(script):
    # forward every round program 0 would take 4 + 2 = 6 and program 1 3 + 1 = 4
    assert script.dealt([4, 3, 2, 1], 2) == 5
    assert script.dealt([4, 3, 2, 1, 1], 2) == 6  # round 2 goes forward again: program 0
    assert script.dealt([7, 1, 1, 1], 3) == 7


def test_greedy_gives_each_item_to_the_program_free_first(script):
    assert script.greedy([4, 3, 2, 1], 2) == 5
    assert script.greedy([3, 3, 2, 2, 2], 2) == 7
    assert script.balance(torch.tensor([4.0, 3, 2, 1]), 2)["dealt_over_perfect"] == 1.0


def test_item_costs_count_walked_key_tiles_heaviest_first(script):
    # S0 at 1/64: one causal sequence of 512 tokens, 128-query and 128-key tiles at d128:
    # query tile i walks i + 1 key tiles, 16 heads each, plus the per-item cost
    got = script.item_costs("S0", 128, item_cost=2, scale=64).tolist()
    assert got == [6.0] * 16 + [5.0] * 16 + [4.0] * 16 + [3.0] * 16


def test_run_writes_its_json(script, monkeypatch, tmp_path):
    argv = ["deal_balance.py", "--out", str(tmp_path), "--cases", "S0-128,S4-128", "--scale", "64"]
    argv += ["--sms", "4"]
    monkeypatch.setattr(sys, "argv", argv)
    script.main()
    (path,) = tmp_path.glob("*-deal-balance-cpu.json")
    got = json.loads(path.read_text())
    assert set(got["cases"]) == {"S0-128", "S4-128"} and got["sms"] == 4
    assert got["cases"]["S0-128"]["items"] == 64 and got["cases"]["S0-128"]["dealt_over_perfect"] >= 1.0
