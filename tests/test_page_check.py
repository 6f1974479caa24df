"""The block-table check (page_check.py) in its three modes, and the clamp that keeps every read
of a bad table inside the cache. CPU tables have no CUDA events: the deferred path is driven
through ``page_check.defer`` on them (a record without an event counts as completed), or with a
stand-in event whose completion the test decides."""

import json

import pytest
import torch
from bench_scripts import load_script

import spanattn as sa
from spanattn import page_check
from spanattn.cache import to_paged

# sequence 0 reads columns 0-2, sequence 1 (kv_len 17) columns 0-1, sequence 2 column 0
BATCH = sa.Batch([sa.Seq(q_len=3, kv_len=40), sa.Seq(q_len=1, kv_len=17), sa.Seq(q_len=5, kv_len=5)])


@pytest.fixture(autouse=True)
def no_pending():
    """Every test starts and ends with no deferred check pending."""
    page_check._pending.clear()
    yield
    page_check._pending.clear()


def _step(batch=BATCH, page=16, seed=0, device="cpu"):
    p = sa.plan(batch, sa.LayerMask(), device=device)
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, p.total_k, 1, 16, generator=g)
    kc, vc, bt = to_paged(k.to(device), v.to(device), p, page, fill=float("nan"), seed=seed)
    q = torch.randn(p.total_q, 2, 16, generator=g).to(device)
    return p, q, kc, vc, bt


def _other(bt):
    """A valid table with other entries than ``bt``: another step's (sequence 2, kv_len 5, reads
    column 0 only)."""
    table = bt.clone()
    table[2, 1:] = table[2, 0] + 1
    assert not torch.equal(table, bt)
    return table


def _brute(bt, kv_lens, num_blocks, page):
    want = []
    for r, kv in enumerate(kv_lens):
        bad = [c for c in range(-(-kv // page)) if not 0 <= int(bt[r, c]) < num_blocks]
        want.append([bad[0], int(bt[r, bad[0]])] if bad else [-1, 0])
    return torch.tensor(want, dtype=torch.int32)


def test_first_bad_entries_against_brute_force_and_the_kernel():
    """Random tables over random lengths (entries past a sequence's keys never count): the torch
    rule equals a per-entry loop, and the one-launch kernel equals the rule, exactly (strided
    tables too)."""
    from triton_cpu import DEV, load

    kernel = load("page_check_triton", "_first_bad_kernel")
    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        n, cols, num_blocks = (int(torch.randint(1, top, (1,), generator=g)) for top in (6, 600, 50))
        page = (16, 32)[trial % 2]
        bt = torch.randint(-3, num_blocks + 3, (n, cols), generator=g, dtype=torch.int32)
        bt[bt == num_blocks + 2] = 2**31 - 1
        if trial % 3 == 0:  # column-major: the kernel takes both strides
            bt = bt.t().contiguous().t()
        lens = torch.randint(1, cols * page + 1, (n,), generator=g, dtype=torch.int32)
        want = _brute(bt, lens.tolist(), num_blocks, page)
        assert torch.equal(page_check.first_bad_entries(bt, lens, num_blocks, page), want)
        got = kernel.first_bad_entries_triton(bt.to(DEV), lens.to(DEV), num_blocks, page)
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("value", [True, False, "deferred", "sync", "off"])
def test_check_pages_takes_its_modes(value):
    p, q, kc, vc, bt = _step()
    bt[2, 1:] = -7  # sequence 2 (kv_len 5) reads column 0 only: the rest may hold anything
    sa.attention(q, kc, vc, p, block_table=bt, backend="reference", check_pages=value)


@pytest.mark.parametrize("value", [1, 0, None, "yes", "SYNC"])
def test_check_pages_refuses_other_values_by_name(value):
    p, q, kc, vc, bt = _step()
    with pytest.raises(ValueError, match="check_pages must be True .* got"):
        sa.attention(q, kc, vc, p, block_table=bt, backend="reference", check_pages=value)


@pytest.mark.parametrize("mode", [True, "sync"])
@pytest.mark.parametrize("value", [-1, 12, 2**31 - 1])
def test_a_cpu_table_raises_in_the_call_naming_the_entry(mode, value):
    p, q, kc, vc, bt = _step()
    bad = bt.clone()
    bad[1, 1] = value
    num_blocks = kc.shape[0]
    with pytest.raises(IndexError, match=rf"block_table\[1, 1\] = {value}: sequence 1 \(kv_len 17\).*"
                       rf"num_blocks={num_blocks}\)$"):  # fmt: skip
        sa.attention(q, kc, vc, p, block_table=bad, backend="reference", check_pages=mode)


def test_a_deferred_check_is_raised_by_the_next_call_naming_the_earlier_step():
    p, q, kc, vc, bt = _step()
    bad = bt.clone()
    bad[2, 0] = -4  # sequence 2 (kv_len 5) reads column 0
    bad[2, 1:] = 99  # and nothing else: never flagged
    page_check.defer(bad, p, kc.shape[0], 16)
    other = sa.plan(sa.Batch([sa.Seq(q_len=1, kv_len=3)]), sa.LayerMask())
    q1, kc1, vc1, bt1 = _step(other.batch)[1:]
    with pytest.raises(IndexError) as err:
        sa.attention(q1, kc1, vc1, other, block_table=bt1, backend="reference")  # another plan
    text = str(err.value)
    assert text.startswith(f"block_table[2, 0] = -4: sequence 2 (kv_len 5) reads that block, but block ids "
                           f"must be in [0, num_blocks={kc.shape[0]})")  # fmt: skip
    assert "EARLIER call" in text and "3 sequences: 9 queries, kv_len 5..40" in text
    assert "this call did not run" in text
    sa.attention(q1, kc1, vc1, other, block_table=bt1, backend="reference")  # raised once
    sa.check_pending_pages()


def test_check_pending_pages_waits_and_raises_in_order():
    p, q, kc, vc, bt = _step()

    class Event:  # a CUDA event's stand-in: completes when synchronized
        def __init__(self):
            self.done = False

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    for value in (None, 20, 30):  # a clean check, then two bad ones
        table = bt.clone()
        if value is not None:
            table[0, 2] = value
        page_check.defer(table, p, kc.shape[0], 16)
    for rec in page_check._pending:
        rec.done = Event()
    sa.attention(q, kc, vc, p, block_table=bt, backend="reference")  # nothing completed: runs
    assert len(page_check._pending) == 3
    with pytest.raises(IndexError, match=r"block_table\[0, 2\] = 20: .*EARLIER.*check_pending_pages"):
        sa.check_pending_pages()
    assert len(page_check._pending) == 1  # the clean one and the first bad one are taken
    page_check._pending[0].done.done = True
    sa.attention(q, kc, vc, p, block_table=bt, backend="reference")  # a table checked before: no query
    assert len(page_check._pending) == 1
    with pytest.raises(IndexError, match=r"block_table\[0, 2\] = 30: .*this call did not run"):
        sa.attention(q, kc, vc, p, block_table=_other(bt), backend="reference")  # the next step's
    sa.check_pending_pages()


def test_a_full_list_of_pending_checks_waits_for_the_oldest():
    p, q, kc, vc, bt = _step()
    bad = bt.clone()
    bad[0, 0] = 50
    page_check.defer(bad, p, kc.shape[0], 16)
    late = type("Late", (), {"query": lambda self: False, "synchronize": lambda self: None})
    page_check._pending[0].done = late()
    for _ in range(page_check.MAX_PENDING - 1):
        page_check.defer(bt, p, kc.shape[0], 16)
    with pytest.raises(IndexError, match=r"block_table\[0, 0\] = 50"):
        page_check.defer(bt, p, kc.shape[0], 16)
    assert len(page_check._pending) == page_check.MAX_PENDING - 1


def _counting(monkeypatch):
    """The checks that read a table's entries, counted."""
    found = []
    real = page_check._find
    monkeypatch.setattr(page_check, "_find", lambda *a: found.append(1) or real(*a))
    return found


def test_each_table_is_checked_once_per_plan_and_mode(monkeypatch):
    p, q, kc, vc, bt = _step()
    found = _counting(monkeypatch)
    sa.attention(q, kc, vc, p, block_table=bt, backend="reference")
    sa.attention(q, kc, vc, p, block_table=bt, backend="reference")
    sa.attention(q, kc, vc, p, block_table=bt.clone(), backend="reference")  # the same entries
    assert len(found) == 1
    sa.attention(q, kc, vc, p, block_table=bt, backend="reference", check_pages="sync")
    assert len(found) == 2
    bt[0, 0] = 99  # changed in place: checked again
    with pytest.raises(IndexError, match="sequence 0"):
        sa.attention(q, kc, vc, p, block_table=bt, backend="reference")


def test_later_layers_of_a_step_do_not_look_at_pending_checks(monkeypatch):
    """Every attention call checks pages: the layers after a step's first, with its table, cost
    one compare (no event query), a new table looks at the pending checks first."""
    p, q, kc, vc, bt = _step()
    sa.attention(q, kc, vc, p, block_table=bt, backend="reference")
    page_check.defer(bt, p, kc.shape[0], 16)  # a pending check (a clean one)
    looked = []
    real = page_check._raise_found
    monkeypatch.setattr(page_check, "_raise_found", lambda *a, **kw: looked.append(1) or real(*a, **kw))
    for _ in range(3):
        sa.attention(q, kc, vc, p, block_table=bt, backend="reference")
    assert looked == []
    sa.attention(q, kc, vc, p, block_table=_other(bt), backend="reference")
    assert looked == [1] and not page_check._pending


@pytest.mark.parametrize("edit", ["numpy", "inference_mode"])
def test_a_table_edited_where_torch_counts_no_version_is_checked_again(edit):
    """A CPU table is known by its entries: an edit through ``.numpy()`` (no version bump) or of
    an inference-mode tensor (no version counter) after a good call is seen by the next call."""
    p, q, kc, vc, bt = _step()
    if edit == "numpy":
        sa.attention(q, kc, vc, p, block_table=bt, backend="reference")
        bt.numpy()[1, 0] = -1
    else:
        with torch.inference_mode():
            bt = bt.clone()
            sa.attention(q, kc, vc, p, block_table=bt, backend="reference")
            bt[1, 0] = -1
    with pytest.raises(IndexError, match=r"block_table\[1, 0\] = -1"):
        sa.attention(q, kc, vc, p, block_table=bt, backend="reference")


def _raised(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except IndexError as err:
        return str(err)
    return None


def missed_bad_tables(run, bt, num_blocks: int, steps: int) -> list:
    """Good and bad tables by turns through ``run(table)``, each a new tensor (often where the
    last one freed lived), one plan: the bad steps whose error was raised neither by their own
    call, nor by the next call (another new, good table), nor by check_pending_pages after it
    (the deferred check of a CUDA table may complete after the next call looked)."""
    g = torch.Generator().manual_seed(1)
    missed = []
    for step in range(steps):
        table = bt.clone()
        value = (10**6, -1, num_blocks)[step % 3]
        if step % 2:
            table[int(torch.randint(0, bt.shape[0], (1,), generator=g)), 0] = value
        raised = _raised(run, table)
        del table  # its memory free for the next step's table
        if step % 2:
            raised = raised or _raised(run, bt.clone()) or _raised(sa.check_pending_pages)
            if raised is None or f"= {value}: sequence" not in raised:
                missed.append((step, raised))
        else:
            assert raised is None, (step, raised)
    return missed


def test_alternating_good_and_bad_tables_raise_for_every_bad_one():
    """A bad table allocated where a checked good one lived was taken as checked (the check was
    keyed by address, version and shape): every bad one raises now, a CPU table in its own call."""
    p, q, kc, vc, bt = _step()
    run = lambda table: sa.attention(q, kc, vc, p, block_table=table, backend="reference")
    assert missed_bad_tables(run, bt, kc.shape[0], 100) == []
    assert len(p._facts["pages_checked"]) <= page_check.REMEMBERED


def test_a_plan_remembers_a_few_tables():
    """20,000 calls with a table touched each time had kept 20,001 keys on the plan."""
    p, q, kc, vc, bt = _step()
    for i in range(200):
        bt[0, 3] = i  # a column sequence 0 never reads: a new version and new entries, still good
        page_check.check(bt, p, kc.shape[0], 16, "deferred")
    assert len(p._facts["pages_checked"]) == page_check.REMEMBERED
    assert not any("pages_checked" in str(key) for key in p._cache)


def test_a_recheck_merges_into_its_pending_result():
    """The kernel's merge: a re-check of a tensor keeps what its earlier launch found."""
    from triton_cpu import DEV, load

    kernel = load("page_check_triton", "_first_bad_kernel")
    p, q, kc, vc, bt = _step()
    bad = bt.clone()
    bad[1, 1] = 77
    lens = p.seq_lens.to(DEV)
    out = kernel.first_bad_entries_triton(bad.to(DEV), lens, kc.shape[0], 16)
    kernel.first_bad_entries_triton(bt.to(DEV), lens, kc.shape[0], 16, out=out, merge=True)
    assert out.cpu().tolist() == [[-1, 0], [1, 77], [-1, 0]]
    worse = bt.clone()
    worse[0, 2] = -5
    kernel.first_bad_entries_triton(worse.to(DEV), lens, kc.shape[0], 16, out=out, merge=True)
    assert out.cpu().tolist() == [[2, -5], [1, 77], [-1, 0]]


def test_sync_mode_under_torch_compile():
    p, q, kc, vc, bt = _step()
    bad = bt.clone()
    bad[1, 1] = 77

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, kc, vc, bt):
        return sa.attention(q, kc, vc, p, block_table=bt, backend="reference", check_pages="sync")

    want = sa.attention(q, kc, vc, p, block_table=bt, backend="reference")
    assert torch.equal(step(q, kc, vc, bt), want)
    with pytest.raises(IndexError, match=r"block_table\[1, 1\] = 77"):
        step(q, kc, vc, bad)


# The clamp: a bad table the check has not caught yet (here check_pages=False) reads inside the
# cache, and every other sequence's output is bit for bit that of the clean table.
DECODE = sa.Batch([sa.Seq(q_len=1, kv_len=97), sa.Seq(q_len=2, kv_len=40), sa.Seq(q_len=1, kv_len=33)])
PREFILL = sa.Batch([sa.Seq(q_len=30, kv_len=90), sa.Seq(q_len=20, kv_len=40), sa.Seq(q_len=17, kv_len=17)])


def _neighbours_unchanged(run, batch, device="cpu"):
    p, q, kc, vc, bt = _step(batch, device=device)
    clean = run(q, kc, vc, p, bt)
    for value in (-3, kc.shape[0], 2**31 - 1):
        bad = bt.clone()
        bad[1, 1] = value  # sequence 1 (queries p.seq_slice(1)) reads its column 1
        got = run(q, kc, vc, p, bad)
        for r in (0, 2):
            rows = p.seq_slice(r)
            assert torch.equal(got[rows], clean[rows]), (value, r)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_dense_backends_clamp_block_ids(backend):
    opts = {"backend": backend, "check_pages": False}
    run = lambda q, kc, vc, p, bt: sa.attention(q, kc, vc, p, block_table=bt, **opts)
    _neighbours_unchanged(run, PREFILL)


@pytest.mark.parametrize("path", ["decode", "prefill-in-place", "prefill-page-copy"])
def test_triton_kernels_clamp_block_ids(monkeypatch, path):
    pytest.importorskip("triton")
    from triton_cpu import DEV

    from spanattn.backends import triton as tb
    from spanattn.backends.triton.configs import Config

    monkeypatch.setattr(tb, "GATHER_PAIRS_PER_KEY", 0 if path == "prefill-page-copy" else 10**9)
    kernel = "auto" if path == "decode" else "prefill"
    config = None if path == "decode" else Config(16, 16, 4, 1)

    def run(q, kc, vc, p, bt):
        return tb.forward(q, kc, vc, p, scale=0.25, block_table=bt, kernel=kernel, config=config)[0]

    _neighbours_unchanged(run, DECODE if path == "decode" else PREFILL, DEV)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the deferred check of a CUDA table")
def test_a_cuda_table_is_checked_without_stopping_the_call():
    p, q, kc, vc, bt = _step(DECODE, device="cuda")
    bad = bt.clone()
    bad[1, 0] = kc.shape[0] + 5
    clean = sa.attention(q, kc, vc, p, block_table=bt)
    out = sa.attention(q, kc, vc, p, block_table=bad)  # runs: its check's result is read later
    for r in (0, 2):
        assert torch.equal(out[p.seq_slice(r)], clean[p.seq_slice(r)])
    with pytest.raises(IndexError, match=rf"block_table\[1, 0\] = {kc.shape[0] + 5}: .*EARLIER"):
        sa.check_pending_pages()
    assert page_check._mapped  # the kernel wrote pinned host memory: no copy back launched
    with pytest.raises(IndexError, match=r"block_table\[1, 0\]"):
        sa.attention(q, kc, vc, p, block_table=bad, check_pages="sync")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the deferred check of a CUDA table")
def test_alternating_good_and_bad_cuda_tables_raise_for_every_bad_one():
    """With the default deferred check: by the bad step's next call or check_pending_pages."""
    p, q, kc, vc, bt = _step(DECODE, device="cuda")
    run = lambda table: sa.attention(q, kc, vc, p, block_table=table)
    assert missed_bad_tables(run, bt, kc.shape[0], 300) == []
    assert len(p._facts["pages_checked"]) <= page_check.REMEMBERED


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the deferred check of a CUDA table")
def test_an_inference_mode_cuda_table_is_checked_at_every_call():
    """No version counter: every call checks it on the device, merged into one pending check."""
    p, q, kc, vc, bt = _step(DECODE, device="cuda")
    with torch.inference_mode():
        table = bt.clone()
        for _ in range(26):  # a model's layers
            sa.attention(q, kc, vc, p, block_table=table)
            assert len(page_check._pending) <= 1
        sa.check_pending_pages()
        table[1, 0] = -3  # edited after good calls
        sa.attention(q, kc, vc, p, block_table=table)
        table[1, 0] = bt[1, 0]  # and repaired: what the check of the bad call found stays
        raised = _raised(sa.attention, q, kc, vc, p, block_table=table) or _raised(sa.check_pending_pages)
    assert raised is not None and raised.startswith("block_table[1, 0] = -3: ") and "EARLIER" in raised


def test_gpu_page_check_script_small(tmp_path):
    """benchmarks/gpu_page_check.py --tiny on CPU: the behaviour pass and every mode timed, steps
    of attention alone and with a model layer's other work."""
    script = load_script("gpu_page_check")
    assert script.main(["--out", str(tmp_path), "--tiny"]) == 0
    (out,) = tmp_path.glob("*-page-check-cpu.json")
    data = json.loads(out.read_text())
    assert data["behaviour"]["ok"] and "block_table[1, 0]" in data["behaviour"]["sync_raised"]
    assert data["env"]["torch"] and "transformers" in data["env"] and len(data["rows"]) == 4
    assert [row["model"] for row in data["rows"]] == [
        False,
        False,
        True,
        True,
    ]  # attention alone; a model step
    assert [row["inference"] for row in data["rows"]] == [False, False, False, True]
    for row in data["rows"]:
        assert all(row[f"step_ms_{m}"] > 0 for m in ("off", "deferred", "sync")) and row["defer_host_ms"] > 0
