import pytest

from cpuos import parse_duration


@pytest.mark.parametrize("given,want", [
    ("15m", 900), ("2m30s", 150), ("1h", 3600), ("90", 90), (90, 90), (1.5, 1.5),
    ("250ms", 0.25), (" 1h 30m ", 5400), ("1d", 86400), ("1.5s", 1.5),
])
def test_ok(given: object, want: float) -> None:
    assert parse_duration(given) == want


@pytest.mark.parametrize("bad", ["", "soon", "15x", "m15", "1h-", "-5", 0, -1, True, None,
                                 float("nan"), float("inf"), "5m5"])
def test_bad(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)
