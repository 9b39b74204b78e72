"""The config field checks (train/checks.py), called directly: TrainConfig builds its checks once at import,
so these tests are where a change of a check's factory shows."""
import math

import pytest

from compactionrl_fast.train import checks as c


def test_config_error_lists_every_problem():
    e = c.ConfigError(["a=1: x", "b=2: y"])
    assert isinstance(e, ValueError) and e.problems == ["a=1: x", "b=2: y"]
    assert str(e) == "invalid config (2 bad fields):\n  a=1: x\n  b=2: y"
    assert str(c.ConfigError(("a=1: x",))) == "invalid config (1 bad field):\n  a=1: x"
    c.raise_problems([])
    with pytest.raises(c.ConfigError) as info:
        c.raise_problems(["z=0: bad"])
    assert info.value.problems == ["z=0: bad"]


def test_is_int_and_is_num():
    assert c.is_int(3) and c.is_int(-1) and not c.is_int(True) and not c.is_int(3.0) and not c.is_int("3")
    assert c.is_num(3) and c.is_num(-2.5) and not c.is_num(False) and not c.is_num(math.inf)
    assert not c.is_num(math.nan) and not c.is_num("1")


def test_integer():
    chk = c.integer(1)
    assert chk(1) is None and chk(7) is None
    for bad in (0, -3, 1.0, True, "2", None):
        assert chk(bad) == "must be an integer >= 1"
    assert c.integer(0)(0) is None and c.integer(0)(-1) == "must be an integer >= 0"


def test_number():
    closed = c.number(0, 1)
    assert closed(0) is None and closed(1) is None and closed(0.5) is None
    for bad in (-1e-9, 1.0000001, math.nan, math.inf, True, "0.5", None):
        assert closed(bad) == "must be a finite number in [0, 1]"
    opened = c.number(0, open_lo=True)
    assert opened(1e-300) is None and opened(1e300) is None
    assert opened(0) == opened(-1) == "must be a finite number in (0, inf)"
    assert c.number(hi=2)(-1e300) is None and c.number(hi=2)(2.5) == "must be a finite number in [-inf, 2]"
    assert c.number()(-5) is None and c.number()(math.inf) == "must be a finite number in [-inf, inf)"
    assert c.number(0.5)(0.5) is None and c.number(0.5)(0.4) == "must be a finite number in [0.5, inf)"


def test_optional():
    chk = c.optional(c.integer(1))
    assert chk(None) is None and chk(2) is None
    assert chk(0) == "must be None or an integer >= 1"
    assert c.optional(c.number(0, 1), "null")(2) == "must be null or a finite number in [0, 1]"


def test_choice():
    chk = c.choice("a", "b")
    assert chk("a") is None and chk("b") is None and chk.choices == ("a", "b")
    for bad in ("c", "", None, ["a"], 1):
        assert chk(bad) == "must be one of ['a', 'b']"


def test_plain_checks():
    assert c.boolean(True) is None and c.boolean(False) is None and c.boolean(1) == "must be true or false"
    assert c.text("x") is None and c.text("") == c.text(3) == "must be a non-empty string"
    assert c.betas([0.9, 0.999]) is None and c.betas((0, 0.5)) is None
    for bad in ([0.9], [0.9, 1.0], [-0.1, 0.5], [0.9, math.nan], "0.9,0.99", [True, 0.5], [0.1, 0.2, 0.3]):
        assert c.betas(bad) == "must be two numbers in [0, 1), e.g. [0.9, 0.999]"
    assert c.lam_value("adaptive") is None and c.lam_value(0) is None and c.lam_value(1) is None
    for bad in ("auto", 1.01, -0.01, math.nan, True):
        assert c.lam_value(bad) == "must be 'adaptive' or a number in [0, 1]"
    assert c.threads("auto") is None and c.threads(0) is None and c.threads(4) is None
    for bad in (-1, "2", 1.0, True):
        assert c.threads(bad) == "must be 'auto' or an integer >= 0"


def test_mapping_and_plain_data():
    assert c.is_plain({"a": [1, 2.0, "x", None, True, {"b": ()}]})
    assert not c.is_plain({"a": object()}) and not c.is_plain({1: 2}) and not c.is_plain([{"a": {3}}])
    assert c.mapping({}) is None and c.mapping({"k": [1, {"j": None}]}) is None
    assert c.mapping([("k", 1)]) == c.mapping({1: 2}) == "must be a mapping of names"
    assert c.mapping({"k": object()}) == \
        "values must be plain data (str, numbers, booleans, None, lists, mappings)"


def test_server_urls_and_their_check():
    assert c.server_urls("http://a:1, http://b:2  http://c:3,") == ["http://a:1", "http://b:2", "http://c:3"]
    assert c.server_urls(("http://a",)) == ["http://a"] and c.server_urls(None) is None
    assert c.urls("http://a,https://b") is None and c.urls([]) is None
    msg = "must be a list of http(s) URLs (or one string of them separated by commas)"
    assert c.urls("ftp://a") == c.urls(["http://a", 3]) == c.urls(None) == c.urls(5) == msg


def test_cpu_binds_and_dtype():
    assert c.cpu_binds(["0", 1, "2-3"]) is None and c.cpu_binds(()) is None
    msg = "must be a list of CPU lists, one per local replica (e.g. ['0', '1'])"
    assert c.cpu_binds("0,1") == c.cpu_binds([True]) == c.cpu_binds([1.5]) == msg
    assert c.dtype("float32") is None and c.dtype("bfloat16") is None
    assert c.dtype("float16").startswith("float16 is not supported: its range overflows")
    assert c.dtype("int8") == "must be one of ['float32', 'bfloat16']"
