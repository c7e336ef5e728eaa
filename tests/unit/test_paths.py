import pytest

from cpuosd.errors import ApiError
from cpuosd.paths import check_id, check_path


@pytest.mark.parametrize("given,want", [
    ("main.py", "/work/main.py"),
    ("/work/a/./b", "/work/a/b"),
    ("/etc/hostname", "/etc/hostname"),
    ("dir/", "/work/dir"),
    ("/work//x", "/work/x"),
    ("%41.txt", "/work/%41.txt"),  # a literal percent sign is a legal name
])
def test_good_paths(given: str, want: str) -> None:
    assert check_path(given) == want


@pytest.mark.parametrize("bad", [
    "", "..", "../x", "/work/../etc", "a/b/../../..", "%2e%2e/x", "%2E%2E", "%252e%252e/x",
    "..%2fetc", "%2e%2e%2f", "a\x00b", "a%00b", "..\\x", "/" + "a" * 4100, "x" * 256,
])
def test_bad_paths(bad: str) -> None:
    with pytest.raises(ApiError) as e:
        check_path(bad)
    assert e.value.status == 422


def test_non_string_path() -> None:
    with pytest.raises(ApiError):
        check_path(None)


@pytest.mark.parametrize("bad", ["", "A", "sbx_1", "a" * 65, "../x", "sbx-1\n"])
def test_bad_ids(bad: str) -> None:
    with pytest.raises(ApiError):
        check_id(bad)


def test_good_id() -> None:
    assert check_id("sbx-abc123") == "sbx-abc123"
