"""spanattn.bench.timing.turns_ms: contenders take turns call by call, who opens a turn rotating."""

from __future__ import annotations

from spanattn.bench.timing import turns_ms


def test_turns_rotate_and_every_contender_gets_every_call():
    log = []
    fns = {n: (lambda n=n: log.append(n)) for n in "abc"}
    times = turns_ms(fns, "cpu", calls=4, first=1)
    assert [log[i : i + 3] for i in range(0, 12, 3)] == [list("bca"), list("cab"), list("abc"), list("bca")]
    assert {n: len(t) for n, t in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(ms >= 0 for t in times.values() for ms in t)
