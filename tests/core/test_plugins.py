import pytest

from pruneops.core.errors import ConfigError
from pruneops.core.plugins import Registry


def test_registry_registers_and_lists_with_summary():
    reg: Registry = Registry("widget")

    @reg.register("b", "second")
    def b():
        """Builds b."""

    @reg.register("a")
    def a():
        """Builds a.

        More text.
        """

    assert reg.names() == ["a", "b"]
    assert [e.summary for e in reg] == ["Builds a.", "second"]
    assert reg.get("a") is a
    assert "b" in reg


def test_unknown_name_lists_the_choices():
    reg: Registry = Registry("widget")
    reg.register("x")(object())
    with pytest.raises(ConfigError, match=r"unknown widget 'y'; choose from: x"):
        reg.get("y")


def test_double_registration_is_an_error():
    reg: Registry = Registry("widget")
    reg.register("x")(1)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("x")(2)
