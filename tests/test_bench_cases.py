"""The benchmark scripts' case names (spanattn.bench.cases): exact parses, and refusals that
name the bad case before any timing."""

from __future__ import annotations

import argparse

import pytest

from spanattn.bench.cases import named_scenarios, packed_cases, parse_case


def test_cases_name_scenario_head_dim_and_page_size():
    assert parse_case("S3-256") == ("S3", 256, 0)
    assert parse_case("S1-128-p16") == ("S1", 128, 16)
    assert parse_case("V2-128") == ("V2", 128, 0)
    assert {"S0", "S5", "D1", "V1", "V2-plain"} <= set(named_scenarios())
    for bad in ("S9-128", "S3", "S3-256-16", "S3-d256"):
        with pytest.raises(ValueError, match=f"'{bad}' is not SCENARIO-HEAD_DIM"):
            parse_case(bad)


def test_pages_are_refused_where_a_script_has_none():
    assert parse_case("S3-256", pages=False) == ("S3", 256, 0)
    with pytest.raises(ValueError, match=r"'S1-128-p16' is not SCENARIO-HEAD_DIM \(e.g. S3-256\)"):
        parse_case("S1-128-p16", pages=False)


def test_packed_cases_parse_a_scripts_list_or_end_the_run_naming_the_bad_one(capsys):
    ap = argparse.ArgumentParser()
    assert packed_cases(ap, "S3-256,S4-128") == {"S3-256": ("S3", 256), "S4-128": ("S4", 128)}
    with pytest.raises(SystemExit):
        packed_cases(ap, "S3-256,S1-128-p16")
    assert "'S1-128-p16' is not SCENARIO-HEAD_DIM" in capsys.readouterr().err


def test_training_scenarios_pack_sixteen_samples_with_images():
    from spanattn.scenarios import training_scenarios

    t = training_scenarios()
    seqs = t["T3"].batch.seqs
    assert t["T3"].batch is t["T3g"].batch and len(seqs) == 16 and sum(s.q_len for s in seqs) == 32768
    assert all(1024 <= s.q_len <= 3584 and s.causal and s.q_len == s.kv_len for s in seqs)
    assert all(len(s.spans) in (1, 2) and all(e - b + 1 == 256 for b, e in s.spans) for s in seqs)
    assert {len(s.spans) for s in seqs} == {1, 2}
    assert t["T1"].batch is not None and t["T5"].head_dims == (512,)
