"""KV-cache layers a session's cache is made of, and the arguments that run a model's forward pass on
one: whole-attention layers that grow in place (``RoomLayer``), windowed layers that can be cut
back (``WindowedLayer``) and copies of them (``WindowedCopy``), and the cache-level helpers
``kvcache`` and the start-up measurements share.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from specdec.runtime.modeling import LoadedModel


@functools.cache
def _cache_keyword(model_class: type) -> str:
    """The forward() keyword of a model class's KV cache: ``cache`` from transformers 5 on
    (``past_key_values`` still works there, with a deprecation warning, until 5.40 removes it),
    ``past_key_values`` in transformers 4 and in model code shipped with a model."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_argument(model: torch.nn.Module, cache: DynamicCache) -> dict[str, object]:
    """The keyword arguments that run ``model``'s forward pass on top of ``cache`` (and extend it)."""
    return {_cache_keyword(type(model)): cache, "use_cache": True}


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    """Whether a model class's forward() takes ``logits_to_keep`` (itself or through ``**kwargs``):
    transformers' models do; model code shipped with a model may predate it."""
    parameters = inspect.signature(model_class.forward).parameters.values()
    return any(p.name == "logits_to_keep" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def logit_rows_argument(model: torch.nn.Module, rows: int) -> dict[str, int]:
    """The keyword argument that has ``model``'s forward pass compute only its last ``rows`` rows of
    logits; none for a model that cannot (it computes every row's, and the caller takes its rows)."""
    return {"logits_to_keep": rows} if _takes_logits_to_keep(type(model)) else {}


class RoomLayer(DynamicLayer):
    """A whole-attention cache layer whose keys and values are the start of memory with room after
    them (``room``: keys and values [batch, heads, capacity, head size]): a pass writes its new
    ones into the room, where transformers' DynamicLayer concatenates them, a copy of the layer's
    whole cache on every pass (a decoding step of the int8 0.5B draft over 30,000 cached tokens
    spent about a third of its time so). When they would not fit, or the room is more than an
    eighth beyond them (a deep cut back), they move to memory with a sixteenth more room than
    they take: a cache that grows is copied once per sixteenth it grows, and holds at most an
    eighth more than its positions after a pass. A copy of the layer (``copy.copy``: prefix reuse, before
    it cuts its copy back) and the layer itself both give up the room they would share, so neither
    writes into what the other sees; each moves at its next pass."""

    room: tuple[torch.Tensor, torch.Tensor] | None = None

    def __copy__(self) -> RoomLayer:
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        self.room = twin.room = None
        return twin

    def fill(self, caches: Sequence[DynamicCache], layer: int, past: int, new: int, like: DynamicLayer) -> None:
        """Makes this a batched pass's layer: each of ``caches``' keys and values of ``layer``
        (shaped like ``like``'s) copied in, each ending at position ``past`` (left-padded with
        zeros), with room for the pass's ``new`` positions after them."""
        rooms = [
            held.new_zeros(len(caches), held.shape[1], past + new, held.shape[3]) for held in (like.keys, like.values)
        ]
        for row, cache in enumerate(caches):
            own = _own_layer(cache, layer)
            if own is not None:
                count = own.keys.shape[2]
                rooms[0][row, :, past - count : past].copy_(own.keys[0])
                rooms[1][row, :, past - count : past].copy_(own.values[0])
        self.room = rooms[0], rooms[1]
        self.keys, self.values = rooms[0][:, :, :past], rooms[1][:, :, :past]
        self.device, self.is_initialized = like.keys.device, True

    def _fits(self, held: int, end: int) -> bool:
        """Whether ``end`` positions fit the room after the ``held`` the layer's keys see, and the
        room is at most an eighth more than them."""
        if self.room is None:
            return False
        keys = self.room[0]
        return self.keys.data_ptr() == keys.data_ptr() and end <= keys.shape[2] <= end + end // 8

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.keys.shape[2] if self.keys.dim() == 4 else 0
        end = held + key_states.shape[2]
        with torch.inference_mode():  # (the room may have been made in a pass: an inference tensor)
            if not self._fits(held, end):
                capacity = end + end // 16  # a sixteenth more: a few positions cut back still fit the eighth
                keys = key_states.new_empty(*key_states.shape[:2], capacity, key_states.shape[3])
                values = value_states.new_empty(*value_states.shape[:2], capacity, value_states.shape[3])
                if held:
                    keys[:, :, :held].copy_(self.keys)
                    values[:, :, :held].copy_(self.values)
                self.room = keys, values
            keys, values = self.room
            keys[:, :, held:end].copy_(key_states)
            values[:, :, held:end].copy_(value_states)
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values


class WindowedLayer(DynamicLayer):
    """The cache of a windowed attention layer (a sliding window, or Llama-4's chunks: a query sees
    at most the ``window`` - 1 positions before it) that can be cut back. transformers' own keeps
    the last window - 1 positions and cannot be cut back once full, as every rejected draft needs;
    this one keeps those and ``margin`` more before them, so a cut of up to ``margin`` tokens still
    leaves the window its next queries see (``margin`` None: every position is kept). Its keys are
    those of positions ``first`` to ``length`` - 1, and the masks it sizes say so."""

    is_sliding = True

    def __init__(self, window: int, margin: int | None) -> None:
        super().__init__()
        self.window = window
        self.limit = None if margin is None else window - 1 + margin  # positions kept at most
        self.length = 0  # positions seen, kept or not

    @property
    def first(self) -> int:
        """The position of the first key kept."""
        return self.length - (self.keys.shape[-2] if self.is_initialized else 0)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states)
        self.length += key_states.shape[-2]
        if self.limit is not None and keys.shape[-2] > self.limit:
            self.keys, self.values = keys[..., -self.limit :, :], values[..., -self.limit :, :]
            if keys.shape[-2] - self.limit > self.limit // 8:  # hold only the kept ones' memory
                # (a decoding step's few keys more are let be: copying the kept ones every step costs)
                self.keys, self.values = self.keys.clone(), self.values.clone()
        return keys, values  # this pass's queries see every key (the mask applies the window)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length - self.first + query_length, self.first

    def get_seq_length(self) -> int:
        return self.length

    def can_cut(self, tokens: int, after: int = 0) -> bool:
        """Whether cutting the last ``tokens`` positions leaves every key the next queries see; with
        ``after``, once a pass has added that many more (and dropped what the limit then drops)."""
        length = self.length + after
        first = self.first if self.limit is None else max(self.first, length - self.limit)
        return first <= max(0, length - tokens - (self.window - 1))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0 or not self.can_cut(-tokens_to_remove):
            raise ValueError(
                f"cannot cut {-tokens_to_remove} positions from a windowed layer holding {self.first} to {self.length}"
            )
        super().crop(tokens_to_remove)
        self.length += tokens_to_remove


def new_cache(config: Any, margin: int | None = None) -> DynamicCache:
    """An empty KV cache for a model of ``config`` whose windowed attention layers can be cut back:
    transformers' cache for the config, each whole-attention layer a RoomLayer (growing in place),
    each windowed layer a WindowedLayer keeping its window and
    ``margin`` positions (None: all of them; a batched pass's cache, whose new keys go back to
    each session's own). The model applies the window through the attention mask it builds on
    every pass, from the config and the positions each layer says it holds."""
    cache = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            cache.layers[index] = WindowedLayer(layer.sliding_window, margin)
        elif type(layer) is DynamicLayer:
            cache.layers[index] = RoomLayer()
    return cache


def keeping(cache: DynamicCache) -> list[tuple[int, Any]]:
    """The layers of ``cache`` that keep keys and values, with their indices: a layer that reads an
    earlier layer's (KV sharing: Gemma-3n, Gemma-4) keeps none, and a copy or a batch skips it."""
    return [(index, layer) for index, layer in enumerate(cache.layers) if layer.keys is not None]


def copied(loaded: LoadedModel, cache: DynamicCache, copies: int, margin: int | None) -> DynamicCache:
    """A cache of ``copies`` copies of ``cache``'s keys and values, one after another (windowed
    layers keeping their window and ``margin``)."""
    longer = new_cache(loaded.model.config, margin)
    for index, layer in keeping(cache):
        longer.update(layer.keys.repeat(1, 1, copies, 1), layer.values.repeat(1, 1, copies, 1), index)
    return longer


def sharing(cache: DynamicCache) -> DynamicCache:
    """A cache of ``cache``'s layers whose keys and values are ``cache``'s own (none copied): one
    to cut back (a cut makes views, never changes the tensors) before it gets its own (``owning``)."""
    shared = copy.copy(cache)
    shared.layers = [copy.copy(layer) for layer in cache.layers]
    return shared


def owning(cache: DynamicCache) -> None:
    """Gives every layer of ``cache`` a copy of its keys and values, of the positions it keeps only."""
    for _, layer in keeping(cache):
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()


def _stored_positions(keys: torch.Tensor) -> int:
    """The positions the memory under ``keys`` (batch, heads, positions, head size) holds."""
    per_position = keys.element_size() * math.prod(keys.shape[:-2]) * keys.shape[-1]
    return keys.untyped_storage().nbytes() // max(1, per_position)


@dataclass(frozen=True)
class WindowedCopy:
    """A copy of a session cache's windowed layers (``WindowedLayer``) taken when it held
    ``length`` tokens: where its turn's prompt ends, or where a prefix that other requests share
    ends (``SessionCache.prompt_end``, ``SessionCache.shared``). A cut back that the layers' margin
    no longer covers can start from it, to any length it reaches, its whole layers cut back as
    usual. Never changed once taken (a cut makes another), so copies of a cache share it."""

    length: int
    layers: dict[int, WindowedLayer]

    @classmethod
    def of(cls, cache: DynamicCache, length: int, upto: int | None = None) -> WindowedCopy:
        """A copy of ``cache`` (holding ``length`` tokens) cut back to ``upto`` tokens (None: not
        cut) before its keys and values are copied, so it holds only what it keeps."""
        layers = {}
        for index, layer in keeping(cache):
            if isinstance(layer, WindowedLayer):
                kept = layers[index] = copy.copy(layer)
                if upto is not None:
                    kept.crop(upto - length)
                kept.keys, kept.values = kept.keys.clone(), kept.values.clone()
        return cls(length if upto is None else upto, layers)

    @functools.cached_property
    def memory(self) -> int:
        """Where its keys and values are held: a copy cut back from another (``cut``) is a view of
        that one's memory, and both name it (read for every copy whenever the budget is counted)."""
        return next((layer.keys.untyped_storage().data_ptr() for layer in self.layers.values()), id(self))

    @functools.cached_property
    def positions(self) -> int:
        """The positions its memory holds in its largest layer: for a copy cut back, those it no
        longer sees too (its view keeps all of them while it is held)."""
        return max((_stored_positions(layer.keys) for layer in self.layers.values()), default=0)

    def reaches(self, length: int) -> bool:
        return length <= self.length and all(layer.can_cut(self.length - length) for layer in self.layers.values())

    def cut(self, length: int) -> WindowedCopy | None:
        """This copy cut back to ``length`` tokens (None where it cannot be)."""
        if not self.reaches(length):
            return None
        layers = {index: copy.copy(layer) for index, layer in self.layers.items()}
        for layer in layers.values():
            layer.crop(length - self.length)
        return WindowedCopy(length, layers)


def layer_bytes(layer: Any) -> int:
    """The memory a cache layer's keys and values take."""
    return sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)


def _own_layer(cache: DynamicCache, layer: int) -> Any | None:
    """One layer of a session's cache, None while it holds no keys (before its first pass)."""
    own = cache.layers[layer] if layer < len(cache.layers) else None
    return own if own is not None and getattr(own, "is_initialized", False) and own.keys is not None else None


def held_positions(cache: DynamicCache, layer: int) -> int:
    """The positions one layer of a session's cache keeps (0 before its first pass)."""
    own = _own_layer(cache, layer)
    return 0 if own is None else own.keys.shape[2]


class WindowedRoom(WindowedLayer, RoomLayer):
    """A windowed layer of a batched pass's cache (every position kept: the rows' new keys and
    values go back to their own caches), filled and written as a RoomLayer."""

    def __init__(self, window: int) -> None:
        super().__init__(window, margin=None)
