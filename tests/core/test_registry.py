"""One Registry type behind every pluggable part: registering, lookup, and the mapping view tests use."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from grouprl.registry import Registry


def one(x):
    return x


def two(x):
    return 2 * x


@dataclass(frozen=True)
class Entry:
    fn: object
    label: str


def test_register_and_get():
    reg = Registry("widget", error=LookupError)
    reg.register("one", one)
    assert reg.get("one") is one and reg["one"] is one and "one" in reg
    reg.register("one", one)  # the same function again: a module executed twice
    with pytest.raises(ValueError, match="widget 'one' is already registered to .*one; cannot register .*two"):
        reg.register("one", two)
    reg.register("one", two, overwrite=True)
    assert reg.get("one") is two
    with pytest.raises(LookupError, match=r"unknown widget 'onee' \(known: one\); did you mean one\?"):
        reg.get("onee")
    assert reg.get("onee", None) is None


def test_lazy_references_are_imported_and_checked_when_asked_for():
    def must_be_callable(name, obj):
        if not callable(obj):
            raise TypeError(f"widget {name!r} is not callable")

    reg = Registry("widget", check=must_be_callable)
    reg.register("dumps", "json:dumps")
    assert reg.get("dumps")([1]) == "[1]"
    reg.register("dumps", "json:dumps")  # the reference to what is registered now: the same entry
    reg.register("sep", "os:sep")
    with pytest.raises(TypeError, match="'sep' is not callable"):
        reg.get("sep")


def test_instances_are_the_same_entry_when_equal():
    reg = Registry("component")
    reg.register("c", Entry(one, "a"))
    reg.register("c", Entry(one, "a"))  # equal metadata: the same entry
    with pytest.raises(ValueError, match="already registered"):
        reg.register("c", Entry(one, "b"))
    with pytest.raises(ValueError, match="already registered"):
        reg.register("c", Entry(two, "a"))


def test_a_registry_is_a_mutable_mapping(monkeypatch):
    reg = Registry("widget")
    reg.register("one", one)
    monkeypatch.setitem(reg, "one", two)  # replaces, like a dict
    monkeypatch.setitem(reg, "new", one)
    assert dict(reg) == {"new": one, "one": two} and len(reg) == 2 and sorted(reg) == ["new", "one"]
    monkeypatch.undo()
    assert dict(reg) == {"one": one}
    del reg["one"]
    assert reg.pop("one", None) is None and len(reg) == 0
    with pytest.raises(KeyError):
        del reg["one"]
    reg.update({"a": one, "b": two})
    reg.clear()
    assert list(reg) == []
