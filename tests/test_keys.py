"""Key validation and the key -> directory-name encoding (properties, with hypothesis)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsstore import FsStoreError, _keys

# Valid key parts: any Unicode scalar string without NUL (lone surrogates are refused).
parts = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=400,
)
common = st.from_regex(r"[-a-zA-Z0-9._/]{1,60}", fullmatch=True)
any_part = st.one_of(parts, common)


@given(any_part)
def test_encoding_round_trips_or_is_hashed(part: str) -> None:
    name = _keys.encode(part)
    if _keys.is_hashed(name):
        assert _keys.decode(name) is None
        assert _keys.matches(name, part)
    else:
        assert _keys.decode(name) == part


@given(any_part, any_part)
def test_encoding_is_injective_even_ignoring_case(a: str, b: str) -> None:
    if a != b:
        assert _keys.encode(a).lower() != _keys.encode(b).lower()


@given(any_part)
def test_names_are_short_ascii_and_never_traverse(part: str) -> None:
    name = _keys.encode(part)
    assert name.isascii() and name.isprintable()
    assert len(name.encode()) <= 255
    assert "/" not in name and "\x00" not in name
    assert name not in (".", "..") and not name.startswith(".")


def test_keys_differing_only_in_case_get_different_names() -> None:
    assert _keys.encode("Session") != _keys.encode("session")
    assert _keys.encode("Session").lower() != _keys.encode("session").lower()


def test_common_keys_stay_readable() -> None:
    assert _keys.encode("6f1c2a34-5b6d-4e7f-8a9b-0c1d2e3f4a5b") == "6f1c2a34-5b6d-4e7f-8a9b-0c1d2e3f4a5b"
    assert _keys.encode("-home-user-repo") == "-home-user-repo"
    assert _keys.encode("-Users-alice-repo") == "-^users-alice-repo"
    assert _keys.encode("subagents/agent-1") == "subagents%2Fagent-1"


def test_only_canonical_names_decode() -> None:
    assert _keys.decode("%61") is None  # 'a' spelled as an escape
    assert _keys.decode("%2e") is None  # lower-case hex digits
    assert _keys.decode("^") is None and _keys.decode("^1") is None
    assert _keys.decode("A") is None


@settings(max_examples=50)
@given(parts)
def test_encoded_names_are_creatable_on_this_filesystem(tmp_path_factory: pytest.TempPathFactory, part: str) -> None:
    d = tmp_path_factory.mktemp("names")
    (d / _keys.encode(part)).mkdir()


BAD_KEYS = [
    ("not a mapping", "k"),
    ("missing session", {"project_key": "p"}),
    ("empty project", {"project_key": "", "session_id": "s"}),
    ("empty session", {"project_key": "p", "session_id": ""}),
    ("non-str project", {"project_key": 1, "session_id": "s"}),
    ("NUL in project", {"project_key": "p\x00", "session_id": "s"}),
    ("NUL in session", {"project_key": "p", "session_id": "s\x00x"}),
    ("lone surrogate", {"project_key": "p\udc80", "session_id": "s"}),
    ("absolute subpath", {"project_key": "p", "session_id": "s", "subpath": "/etc/passwd"}),
    ("trailing slash", {"project_key": "p", "session_id": "s", "subpath": "a/"}),
    ("double slash", {"project_key": "p", "session_id": "s", "subpath": "a//b"}),
    ("dot segment", {"project_key": "p", "session_id": "s", "subpath": "a/./b"}),
    ("dotdot segment", {"project_key": "p", "session_id": "s", "subpath": "../x"}),
    ("bare dotdot", {"project_key": "p", "session_id": "s", "subpath": ".."}),
    ("NUL in subpath", {"project_key": "p", "session_id": "s", "subpath": "a\x00"}),
    ("non-str subpath", {"project_key": "p", "session_id": "s", "subpath": 3}),
]


@pytest.mark.parametrize("why,key", BAD_KEYS, ids=[b[0] for b in BAD_KEYS])
def test_malformed_keys_are_rejected_before_touching_disk(
    store, root: Path, why: str, key: object  # type: ignore[no-untyped-def]
) -> None:
    for call in (lambda: store.append(key, [{"type": "x"}]), lambda: store.load(key),
                 lambda: store.delete(key)):
        with pytest.raises(FsStoreError) as info:
            call()
        assert info.value.code == "INVALID_KEY"
        assert info.value.errno is None
    assert not root.exists()


def test_empty_or_none_subpath_is_the_main_transcript(store) -> None:  # type: ignore[no-untyped-def]
    store.append({"project_key": "p", "session_id": "s", "subpath": ""}, [{"type": "a"}])
    store.append({"project_key": "p", "session_id": "s", "subpath": None}, [{"type": "b"}])
    assert store.load({"project_key": "p", "session_id": "s"}) == [{"type": "a"}, {"type": "b"}]
    assert store.list_subkeys({"project_key": "p", "session_id": "s"}) == []


@settings(max_examples=40)
@given(st.lists(st.from_regex(r"[a-zA-Z0-9é/-]{1,12}", fullmatch=True), min_size=2, max_size=8, unique=True))
def test_no_collisions_on_a_case_insensitive_filesystem(parts: list[str]) -> None:
    # pyfakefs emulates a case-insensitive (macOS/Windows-like) filesystem in memory.
    from pyfakefs.fake_filesystem import FakeFilesystem

    fs = FakeFilesystem()
    fs.is_case_sensitive = False
    fs.create_dir("/store/Probe")
    assert fs.exists("/store/PROBE")  # the emulation really ignores case
    for part in parts:
        fs.create_dir(f"/store/{_keys.encode(part)}")  # raises if the name collides
    assert len(fs.listdir("/store")) == len(parts) + 1
