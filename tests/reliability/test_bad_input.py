"""Bad input: every malformed key shape and every entry json.dumps rejects or mangles.

A rejected call is an FsStoreError (INVALID_KEY / INVALID_ENTRY) naming the
operation, and nothing is written: the store tree is byte-for-byte what it was.
What JSON changes rather than rejects is tested as the documented behaviour
(README "Entries"): NaN/Infinity round-trip, big integers round-trip, lone
surrogates round-trip, non-str dict keys come back as strings, tuples as lists.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import json
import math
import os
import tempfile
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsstore import FsStoreError
from fsstore._store import SyncStore

from ._check import assert_summaries_consistent, snapshot

GOOD = {"project_key": "-home-user-repo", "session_id": "s"}
ENTRY = {"type": "user", "message": {"role": "user", "content": "hi"}}


def populated(tmp_path: Path) -> tuple[SyncStore, Path]:
    root = tmp_path / "store"
    store = SyncStore(root, create=True)
    store.append(GOOD, [ENTRY])
    store.append({**GOOD, "subpath": "agents/a"}, [ENTRY])
    return store, root


# -- keys ------------------------------------------------------------------------------

BAD_KEYS: dict[str, Any] = {
    "not a mapping (None)": None,
    "not a mapping (str)": "proj/sess",
    "not a mapping (list)": ["proj", "sess"],
    "no project_key": {"session_id": "s"},
    "no session_id": {"project_key": "p"},
    "empty project_key": {"project_key": "", "session_id": "s"},
    "empty session_id": {"project_key": "p", "session_id": ""},
    "project_key not a str (int)": {"project_key": 1, "session_id": "s"},
    "project_key not a str (bytes)": {"project_key": b"p", "session_id": "s"},
    "session_id not a str (None)": {"project_key": "p", "session_id": None},
    "session_id not a str (bool)": {"project_key": "p", "session_id": True},
    "NUL in project_key": {"project_key": "p\x00", "session_id": "s"},
    "NUL in session_id": {"project_key": "p", "session_id": "s\x00x"},
    "NUL in subpath": {"project_key": "p", "session_id": "s", "subpath": "a\x00b"},
    "lone surrogate in project_key": {"project_key": "p\ud800", "session_id": "s"},
    "lone surrogate in session_id": {"project_key": "p", "session_id": "\udfff"},
    "lone surrogate in subpath": {"project_key": "p", "session_id": "s", "subpath": "a/\ud83d"},
    "subpath not a str": {"project_key": "p", "session_id": "s", "subpath": 5},
    "absolute subpath": {"project_key": "p", "session_id": "s", "subpath": "/etc/passwd"},
    "subpath '/'": {"project_key": "p", "session_id": "s", "subpath": "/"},
    "subpath with //": {"project_key": "p", "session_id": "s", "subpath": "a//b"},
    "subpath ending in /": {"project_key": "p", "session_id": "s", "subpath": "a/"},
    "subpath '.'": {"project_key": "p", "session_id": "s", "subpath": "."},
    "subpath '..'": {"project_key": "p", "session_id": "s", "subpath": ".."},
    "subpath ./a": {"project_key": "p", "session_id": "s", "subpath": "./a"},
    "subpath a/./b": {"project_key": "p", "session_id": "s", "subpath": "a/./b"},
    "subpath ../../x": {"project_key": "p", "session_id": "s", "subpath": "../../x"},
    "subpath a/..": {"project_key": "p", "session_id": "s", "subpath": "a/.."},
}


def call(store: SyncStore, op: str, key: Any) -> Any:
    if op == "append":
        return store.append(key, [ENTRY])
    if op == "load":
        return store.load(key)
    if op == "delete":
        return store.delete(key)
    if op == "list_subkeys":
        return store.list_subkeys(key)
    if op == "lock":
        with store.locked(key):
            return None
    raise AssertionError(op)


# list_subkeys(key) ignores key["subpath"] (it lists them), so it only sees the other shapes
KEY_CASES = [
    (name, op)
    for name in BAD_KEYS
    for op in ("append", "load", "delete", "list_subkeys", "lock")
    if not (op == "list_subkeys" and "subpath" in name)
]


@pytest.mark.parametrize(("name", "op"), KEY_CASES)
def test_malformed_key_is_invalid_key_and_writes_nothing(tmp_path: Path, name: str, op: str) -> None:
    key = BAD_KEYS[name]
    store, root = populated(tmp_path)
    before = snapshot(root)
    with pytest.raises(FsStoreError) as info:
        call(store, op, key)
    assert info.value.code == "INVALID_KEY", info.value
    assert info.value.operation == op
    assert "INVALID_KEY" in str(info.value)
    assert snapshot(root) == before


@pytest.mark.parametrize("project_key", ["", None, 7, b"p", "p\x00", "p\udc80"])
def test_malformed_project_key_in_listings_is_invalid_key(tmp_path: Path, project_key: Any) -> None:
    store, root = populated(tmp_path)
    before = snapshot(root)
    for op in ("list_sessions", "list_session_summaries"):
        with pytest.raises(FsStoreError) as info:
            getattr(store, op)(project_key)
        assert info.value.code == "INVALID_KEY" and info.value.operation == op
    assert snapshot(root) == before


def test_rejected_key_on_an_empty_root_creates_nothing(tmp_path: Path) -> None:
    store = SyncStore(tmp_path / "store", create=True)
    for key in BAD_KEYS.values():
        with pytest.raises(FsStoreError):
            store.append(key, [ENTRY])
    assert not (tmp_path / "store").exists()


def test_empty_or_none_subpath_is_the_main_transcript(tmp_path: Path) -> None:
    """Documented: subpath absent, None or "" all name the main transcript."""
    store = SyncStore(tmp_path / "store", create=True)
    store.append({**GOOD, "subpath": ""}, [{"n": 1}])
    store.append({**GOOD, "subpath": None}, [{"n": 2}])
    assert store.load(GOOD) == [{"n": 1}, {"n": 2}]
    assert store.list_subkeys(GOOD) == []


STRANGE_BUT_VALID = {
    "dot": ".",
    "dotdot": "..",
    "slashes": "a//b/../c",
    "absolute-looking": "/etc/passwd",
    "percent": "%2E%2E",
    "caret": "^a",
    "tilde": "x~0123456789abcdef0123456789abcdef",
    "spaces": " lead and trail ",
    "newline": "a\nb",
    "non-ascii": "séance-日本語-🦀",
    "nfc": unicodedata.normalize("NFC", "café"),
    "nfd": unicodedata.normalize("NFD", "café"),
    "rtl": "\u05e9\u05dc\u05d5\u05dd",
    "zero-width": "a\u200db",
    "long": "L" * 10_000,
    "long-non-ascii": "é" * 5_000,
}


def test_strange_but_valid_keys_round_trip_inside_root(tmp_path: Path) -> None:
    """Key parts are opaque strings: '.', '..', '/', non-ASCII, 10k characters all work,
    stay inside root, and list back exactly."""
    outside = tmp_path
    root = tmp_path / "store"
    store = SyncStore(root, create=True)
    before_outside = {p for p in os.listdir(outside)}
    for i, (label, part) in enumerate(STRANGE_BUT_VALID.items()):
        for key in (
            {"project_key": part, "session_id": f"s{i}"},
            {"project_key": "p", "session_id": part},
            {"project_key": "p", "session_id": "sub", "subpath": f"agents/{part}" if "/" not in part and part not in (".", "..") else "x"},
        ):
            store.append(key, [{"label": label, "key": key}])
    for i, (label, part) in enumerate(STRANGE_BUT_VALID.items()):
        assert store.load({"project_key": part, "session_id": f"s{i}"}) == [
            {"label": label, "key": {"project_key": part, "session_id": f"s{i}"}}
        ]
        assert [s["session_id"] for s in store.list_sessions(part)] == [f"s{i}"]
    listed = {s["session_id"] for s in store.list_sessions("p")}
    assert set(STRANGE_BUT_VALID.values()) == listed  # "sub" has subpaths only: not a session
    assert set(os.listdir(outside)) == before_outside | {"store"}
    # nothing but the store's own tree, every name ASCII and not starting with '.'
    for dirpath, dirnames, filenames in os.walk(root):
        assert Path(dirpath).resolve().is_relative_to(root.resolve())
        for name in dirnames:
            assert name.isascii() and len(name.encode()) <= 255
            # key-derived names never start with '.'; the store's own ones do
            assert not name.startswith(".") or name in (".trash", ".locks") or name.startswith(".tmp-")
    assert_summaries_consistent(store, "p")


def test_keys_differing_only_in_case_or_normalization_are_different_transcripts(tmp_path: Path) -> None:
    store = SyncStore(tmp_path / "store", create=True)
    variants = ["Session", "session", "SESSION", "sESSION",
                unicodedata.normalize("NFC", "é"), unicodedata.normalize("NFD", "é")]
    for v in variants:
        store.append({"project_key": "P", "session_id": v}, [{"v": v}])
        store.append({"project_key": "p", "session_id": v, "subpath": f"Agent/{v}"}, [{"v": v}])
        store.append({"project_key": "p", "session_id": v, "subpath": f"agent/{v}"}, [{"v": v.lower()}])
    for v in variants:
        assert store.load({"project_key": "P", "session_id": v}) == [{"v": v}]
        assert store.load({"project_key": "p", "session_id": v}) is None
        assert sorted(store.list_subkeys({"project_key": "p", "session_id": v})) == sorted([f"Agent/{v}", f"agent/{v}"])
    assert sorted(s["session_id"] for s in store.list_sessions("P")) == sorted(variants)


key_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.tuples(key_text, key_text), min_size=1, max_size=6, unique=True))
def test_any_valid_keys_round_trip_and_never_share_a_transcript(parts: list[tuple[str, str]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = SyncStore(Path(tmp) / "store", create=True, summaries=False)
        for i, (pk, sid) in enumerate(parts):
            store.append({"project_key": pk, "session_id": sid}, [{"i": i}])
        for i, (pk, sid) in enumerate(parts):
            assert store.load({"project_key": pk, "session_id": sid}) == [{"i": i}]
        projects: dict[str, set[str]] = collections.defaultdict(set)
        for pk, sid in parts:
            projects[pk].add(sid)
        for pk, sids in projects.items():
            assert {s["session_id"] for s in store.list_sessions(pk)} == sids


# -- entries -----------------------------------------------------------------------------


class Custom:
    pass


def circular() -> dict[str, Any]:
    d: dict[str, Any] = {"type": "user"}
    d["self"] = d
    return d


def deep(n: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for _ in range(n):
        d = {"d": d}
    return d


BAD_ENTRIES: dict[str, Any] = {
    "entries is a tuple": (ENTRY,),
    "entries is a dict": ENTRY,
    "entries is a generator": (e for e in [ENTRY]),
    "entries is None": None,
    "entries is a str": "[{}]",
    "entry is a list": [[1, 2]],
    "entry is a str": ['{"type": "user"}'],
    "entry is None": [None],
    "a set value": [{"tags": {"a", "b"}}],
    "a frozenset value": [{"tags": frozenset()}],
    "a bytes value": [{"blob": b"\x00\x01"}],
    "a bytearray value": [{"blob": bytearray(b"x")}],
    "a complex value": [{"z": 1j}],
    "a Decimal value": [{"price": decimal.Decimal("1.10")}],
    "a datetime value": [{"at": datetime.datetime(2025, 1, 1)}],
    "an object value": [{"obj": Custom()}],
    "a tuple dict key": [{(1, 2): "pair"}],
    "a frozenset dict key": [{frozenset(): "x"}],
    "a circular entry": [circular()],
    "nesting deeper than the recursion limit": [deep(100_000)],
    "an int over 4300 digits": [{"n": 10**5000}],
    "a good entry then a bad one": [ENTRY, {"bad": {1, 2}}],
}


@pytest.mark.parametrize("name", list(BAD_ENTRIES))
def test_entry_json_rejects_is_invalid_entry_and_writes_nothing(tmp_path: Path, name: str) -> None:
    store, root = populated(tmp_path)
    before = snapshot(root)
    with pytest.raises(FsStoreError) as info:
        store.append(GOOD, BAD_ENTRIES[name])
    assert info.value.code == "INVALID_ENTRY", info.value
    assert info.value.operation == "append"
    assert snapshot(root) == before
    assert store.load(GOOD) == [ENTRY]


def test_rejected_batch_for_a_new_session_creates_no_directory(tmp_path: Path) -> None:
    store, root = populated(tmp_path)
    before = snapshot(root)
    with pytest.raises(FsStoreError):
        store.append({"project_key": "new", "session_id": "new"}, [{"x": {1}}])
    assert snapshot(root) == before


def round_trip(tmp_path: Path, entry: dict[str, Any]) -> dict[str, Any]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = SyncStore(tmp_path / "store", create=True)
    store.append(GOOD, [entry])
    loaded = store.load(GOOD)
    assert loaded is not None and len(loaded) == 1
    return loaded[0]


def test_nan_and_infinity_round_trip_as_floats(tmp_path: Path) -> None:
    got = round_trip(tmp_path, {"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "l": [math.nan]})
    assert math.isnan(got["nan"]) and math.isnan(got["l"][0])
    assert got["inf"] == math.inf and got["ninf"] == -math.inf
    # written the way Python's json writes them (not strict JSON; docs/format.md says so)
    part = next(Path(tmp_path, "store").rglob("0*.jsonl"))
    assert b"NaN" in part.read_bytes() and b"Infinity" in part.read_bytes()


def test_integers_beyond_64_bits_round_trip_exactly(tmp_path: Path) -> None:
    values = [2**63, 2**64, -(2**64) - 1, 2**200, -(10**4000), 10**4299 + 7]
    got = round_trip(tmp_path, {"ints": values})
    assert got["ints"] == values
    assert all(type(v) is int for v in got["ints"])


def test_floats_round_trip(tmp_path: Path) -> None:
    values = [0.1, -0.0, 1e308, 5e-324, 1.7976931348623157e308, 2.0**-1074]
    got = round_trip(tmp_path, {"floats": values})
    assert got["floats"] == values
    assert math.copysign(1.0, got["floats"][1]) == -1.0


def test_lone_surrogates_round_trip_in_values_and_keys(tmp_path: Path) -> None:
    entry = {"s": "a\ud800b", "\udfffkey": ["\ud83d"], "ok": "🦀\u2028\u2029\x00"}
    assert round_trip(tmp_path, entry) == entry


def test_non_str_dict_keys_come_back_as_strings(tmp_path: Path) -> None:
    """Documented mangling (as any JSON store): int/float/bool/None keys become strings,
    and a key that collides after conversion keeps the last value."""
    got = round_trip(tmp_path, {7: "int", 2.5: "float", True: "bool", None: "none", "t": (1, (2, 3))})
    assert got == {"7": "int", "2.5": "float", "true": "bool", "null": "none", "t": [1, [2, 3]]}
    collided = round_trip(tmp_path / "b", {1: "from int", "1": "from str"})
    assert collided == {"1": "from str"}


def test_dict_subclasses_are_accepted(tmp_path: Path) -> None:
    entry = collections.OrderedDict([("b", 1), ("a", collections.defaultdict(int, {"x": 2}))])
    assert round_trip(tmp_path, entry) == {"b": 1, "a": {"x": 2}}


def test_fifty_megabyte_entry_round_trips_and_is_summarised(tmp_path: Path, figures: Any) -> None:
    big = "x" * (50 * 1024 * 1024)
    store = SyncStore(tmp_path / "store", create=True)
    entry = {"type": "user", "message": {"role": "user", "content": big}, "lastPrompt": big[:20_000_000]}
    store.append(GOOD, [entry])
    store.append(GOOD, [ENTRY])
    loaded = store.load(GOOD)
    assert loaded is not None and loaded[0] == entry and loaded[1] == ENTRY
    summaries = store.list_session_summaries(GOOD["project_key"])
    assert [s["session_id"] for s in summaries] == [GOOD["session_id"]]  # still listed, not left out
    assert assert_summaries_consistent(store, GOOD["project_key"]) == 1
    figures.add("appends", 2)


def test_entries_are_stored_as_ascii_json_lines(tmp_path: Path) -> None:
    store = SyncStore(tmp_path / "store", create=True)
    store.append(GOOD, [{"t": "é\n🦀", "u": "\u2028"}])
    data = next(Path(tmp_path, "store").rglob("0*.jsonl")).read_bytes()
    assert data.isascii() and data.count(b"\n") == 1
    assert json.loads(data) == {"t": "é\n🦀", "u": "\u2028"}
