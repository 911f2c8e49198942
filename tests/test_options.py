"""CommunicationOptions: validation and merging (their use per strategy and per call is
tested in test_cross_device_ops.py and test_contract.py)."""

import pytest

from mirrored.experimental import CommunicationImplementation, CommunicationOptions


def test_defaults():
    options = CommunicationOptions()
    assert options.bytes_per_pack == 25 * (1 << 20)
    assert options.timeout_seconds is None
    assert options.implementation is CommunicationImplementation.AUTO


@pytest.mark.parametrize("value", [-1, 1.5, True, "10"])
def test_bad_bytes_per_pack(value):
    with pytest.raises(ValueError, match=r"bytes_per_pack must be an int >= 0"):
        CommunicationOptions(bytes_per_pack=value)


@pytest.mark.parametrize("value", [0, -2.0, float("inf"), float("nan"), "1", True])
def test_bad_timeout(value):
    with pytest.raises(ValueError, match=r"timeout_seconds must be None \(no limit\) or a finite "
                                         r"number of seconds > 0"):
        CommunicationOptions(timeout_seconds=value)


def test_implementation_names_and_errors():
    assert CommunicationOptions(implementation="nccl").implementation is (
        CommunicationImplementation.NCCL)
    with pytest.raises(ValueError, match=r"implementation must be one of "
                                         r"CommunicationImplementation.AUTO, RING, NCCL .*got str "
                                         r"'gloo'"):
        CommunicationOptions(implementation="gloo")


def test_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        CommunicationOptions(10)  # type: ignore[misc]
    options = CommunicationOptions()
    with pytest.raises(AttributeError):
        options.timeout_seconds = 3  # type: ignore[misc]


def test_merge_takes_non_default_fields_of_the_override():
    base = CommunicationOptions(bytes_per_pack=10, timeout_seconds=5)
    merged = base.merge(CommunicationOptions(timeout_seconds=1))
    assert (merged.bytes_per_pack, merged.timeout_seconds) == (10, 1.0)
    assert base.merge(None) is base
    with pytest.raises(TypeError, match=r"options must be a mirrored\.experimental"):
        base.merge({"timeout_seconds": 1})  # type: ignore[arg-type]
