"""kvpack bench-store prints the floor of the same chunks and, beside each get, the
fraction of the floor's rate it reaches (floor seconds / get seconds)."""

from __future__ import annotations

from kvpack.bench.store import BenchOptions, floor_fraction, format_table, run


def test_the_floor_and_each_gets_fraction_of_it(tmp_path):
    opts = BenchOptions(total_mib=4, chunk_mib=1, concurrency=2, backends=("local",),
                        work_dir=tmp_path)  # fmt: skip
    rows, floor = run(opts, log=lambda _: None)
    assert floor.bytes == 4 << 20 and floor.seconds > 0
    gets = [r for r in rows if r.op == "get"]
    assert {r.path for r in gets} == {"chunk store (sealed)", "raw files"}
    assert all(r.valid for r in rows)
    table = format_table(rows, floor, opts)
    assert f"{floor.rate / (1 << 20):.1f} MiB/s" in table.splitlines()[1]
    for r in gets:
        fraction = floor_fraction(r, floor)
        assert fraction == floor.seconds / r.seconds
        (line,) = [ln for ln in table.splitlines() if ln.startswith(r.path) and " get " in ln]
        assert line.split()[-1] == f"{fraction:.2f}"
    puts = [r for r in rows if r.op != "get"]
    assert all(floor_fraction(r, floor) is None for r in puts)  # not a restore of its bytes
