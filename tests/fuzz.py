"""Hypothesis strategies for fuzzing protobuf requests: any value of a field's type, and a message
with a few of its fields set to such values (the tests that send any request a client can)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st


def values_of(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Values of a scalar field's type: any of them, its edges (-1, 0, 1, the least and largest),
    and small ones that validation decides on (ids within the vocabulary, counts near the limits,
    rates in [0, 1]), these more often."""
    kind = field.type
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=16)
    if kind == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=24) | st.sampled_from(["", "user", "system", "{}", '{"type": "object"}', "[a-z]+"])
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        small = st.floats(0, 1, width=32)
        return st.one_of(small, small, small, st.floats(width=32 if kind == FieldDescriptor.TYPE_FLOAT else 64))
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.integers(0, 8)  # unknown values too: a newer client's
    bits = 64 if kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT64) else 32
    signed = kind in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64)
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    edges = st.sampled_from(sorted({low, max(low, -1), 0, 1, high}))
    return st.one_of(edges, st.integers(max(low, -2), 12), st.integers(low, high), st.integers(0, 130))


def fill_any(
    draw: Callable[[st.SearchStrategy[Any]], Any], message: Message, depth: int = 0, keep: frozenset[str] = frozenset()
) -> None:
    """Sets up to 4 of ``message``'s fields (the others keep their defaults, so that every check
    is reached), nested messages, lists and maps included; the fields named in ``keep`` are left as
    they are."""
    names = [field.name for field in message.DESCRIPTOR.fields if field.name not in keep]
    for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
        field, held = message.DESCRIPTOR.fields_by_name[name], getattr(message, name)
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            if value.message_type is None:
                held.update(draw(st.dictionaries(values_of(key), values_of(value), max_size=4)))
            elif depth < 3:
                for k in draw(st.lists(values_of(key), max_size=3, unique=True)):
                    held[k].SetInParent()
                    fill_any(draw, held[k], depth + 1)
        elif entry is not None and depth < 3:
            for item in [held.add() for _ in range(draw(st.integers(0, 3)))] if field.is_repeated else [held]:
                item.SetInParent()
                fill_any(draw, item, depth + 1)
        elif entry is None and field.is_repeated:
            held.extend(draw(st.lists(values_of(field), max_size=5)))
        elif entry is None:
            setattr(message, name, draw(values_of(field)))
