"""benchmarks/check_speedups.py (`make bench-check`) on fake timings: the floor comparison, the exit code,
the JSON rows and --record. Nothing is timed."""
import importlib
import json

from benchmarks import check_speedups as cs

FLOORS = {"recorded": {"git": "abc"}, "ops": {"fast": {"speedup": 10.0, "floor": 5.0},
                                              "slow": {"speedup": 4.0, "floor": 2.0}}}


def fake_measure(timings):
    """A stand-in for cs.measure: {op: (ref ms, op ms)} -> its result format."""
    return lambda budget_s, only=None: {op: {"ref_ms": r, "op_ms": o, "rounds": 7} for op, (r, o) in timings.items()
                                        if only is None or op in only}


def run(tmp_path, timings, *args):
    floors = tmp_path / "floors.json"
    if not floors.exists():
        floors.write_text(json.dumps(FLOORS))
    out = tmp_path / "check.json"
    code = cs.main(["--floors", str(floors), "--json", str(out), *args], measure=fake_measure(timings))
    return code, {r["op"]: r for r in json.loads(out.read_text())["rows"]}


def test_judge_compares_speedup_with_floor():
    rows = cs.judge({"a": {"ref_ms": 10.0, "op_ms": 2.0}, "b": {"ref_ms": 10.0, "op_ms": 2.5},
                     "c": {"ref_ms": 1.0, "op_ms": 1.0}}, {"a": {"floor": 5.0}, "b": {"floor": 5.0}})
    assert [(r["op"], r["speedup"], r["status"]) for r in rows] == [("a", 5.0, "OK"), ("b", 4.0, "FAIL"),
                                                                    ("c", 1.0, "FAIL")]  # c: no floor


def test_passes_above_every_floor(tmp_path):
    code, rows = run(tmp_path, {"fast": (10.0, 1.0), "slow": (3.0, 1.0)})
    assert code == 0
    assert {op: r["status"] for op, r in rows.items()} == {"fast": "OK", "slow": "OK"}
    assert rows["fast"]["speedup"] == 10.0 and rows["fast"]["floor"] == 5.0


def test_fails_when_one_op_is_below_its_floor(tmp_path, capsys):
    code, rows = run(tmp_path, {"fast": (10.0, 7.0), "slow": (3.0, 1.0)})  # fast: 1.43x < 5
    assert code == 1
    assert rows["fast"]["status"] == "FAIL" and rows["slow"]["status"] == "OK"
    assert "FAILED: fast" in capsys.readouterr().out


def test_an_op_without_a_floor_fails(tmp_path):
    code, rows = run(tmp_path, {"fast": (10.0, 1.0), "new": (100.0, 1.0)})
    assert code == 1 and rows["new"]["status"] == "FAIL" and rows["new"]["floor"] is None


def test_record_writes_half_the_speedups(tmp_path):
    code, _ = run(tmp_path, {"fast": (9.0, 1.0), "slow": (3.0, 2.0)}, "--record")
    assert code == 0
    saved = json.loads((tmp_path / "floors.json").read_text())
    assert saved["ops"] == {"fast": {"speedup": 9.0, "floor": 4.5}, "slow": {"speedup": 1.5, "floor": 0.75}}
    assert {"git", "date", "loadavg_at_start", "threads", "command"} <= set(saved["recorded"])
    assert run(tmp_path, {"fast": (9.0, 2.5), "slow": (3.0, 2.0)})[0] == 1  # 3.6x < 4.5 against the new floors


def test_record_only_keeps_the_other_floors(tmp_path):
    code, rows = run(tmp_path, {"fast": (9.0, 1.0), "slow": (3.0, 2.0)}, "--record", "--only", "slow")
    assert code == 0 and set(rows) == {"slow"}
    saved = json.loads((tmp_path / "floors.json").read_text())
    assert saved["ops"]["fast"] == {"speedup": 10.0, "floor": 5.0} and saved["recorded"] == {"git": "abc"}
    slow = saved["ops"]["slow"]
    assert (slow["speedup"], slow["floor"]) == (1.5, 0.75) and {"git", "date", "command"} <= set(slow["recorded"])


def test_every_registered_speed_key_has_a_case_and_a_floor():
    """The registry's speed keys (compactionrl_fast/ops/_registry.py) are what check_speedups times: each has a
    case in its op's benchmark module and a floor in the committed floors file, and no floor is left over."""
    from compactionrl_fast.ops._registry import SPECS

    keys = [k for s in SPECS.values() for k in s.speed]
    made = {}
    for s in SPECS.values():
        if s.speed:
            made.setdefault(s.bench, set(importlib.import_module(f"benchmarks.{s.bench}").speed_check()))
            assert set(s.speed) <= made[s.bench], f"{s.name}: benchmarks/{s.bench}.py speed_check() lacks {s.speed}"
    with open(cs.FLOORS) as f:
        floors = json.load(f)["ops"]
    assert sorted(floors) == sorted(keys), "floors file keys != the registry's speed keys: record the new one " \
                                           "(python benchmarks/check_speedups.py --record --only KEY)"
