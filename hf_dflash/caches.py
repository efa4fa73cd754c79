"""Cache utilities shared by decoding and regeneration: rectangular caches whose rows hold holes.

Both the batched DFlash loop and continuous-batching regeneration keep ONE `DynamicCache` for rows of
different true lengths, with a (B, T) validity mask (1 where a slot holds a token of that row), exactly
like left padding. This module holds what they share: the cache keyword of a target's forward, measuring
and compacting the holes, merging caches, and a layer with reserved free slots.
"""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword of `model.forward`'s cache argument: Transformers 5.24 renamed `past_key_values` to
    `cache` (the old name warns until 5.40); 5.23 knows only `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# Compact a cache when more than this fraction of its slots lies beyond the tightest layout.
MAX_WASTE_FRACTION = 0.25


def cache_waste(mask: torch.Tensor) -> int:
    """Slots of a rectangular cache beyond the tightest left-padded layout of its rows.

    mask (B, T): 1 where a slot holds a token of that row. Returns T - max_b(valid slots of row b).
    """
    return mask.shape[1] - int(mask.sum(1).max())


def needs_compaction(mask: torch.Tensor) -> bool:
    """Whether the holes of a cache with validity mask (B, T) exceed `MAX_WASTE_FRACTION` of its slots."""
    return cache_waste(mask) > MAX_WASTE_FRACTION * mask.shape[1]


def compact_cache(cache: Cache, mask: torch.Tensor) -> torch.Tensor:
    """Keep each row's valid slots of every layer, in order, left-padded to the longest row.

    Layers hold keys/values (B, H, T, D); mask (B, T). Returns the new mask (B, T'), T' = max valid.
    Layers are refilled through their own `reset` + `update`, so their bookkeeping (the cumulative
    length of sliding-window layers) stays consistent.
    """
    valid = mask.bool()
    width = int(valid.sum(1).max())
    # A stable sort of the 0/1 mask puts invalid slots first and keeps the order of the valid ones.
    order = torch.sort(valid.int(), dim=1, stable=True).indices[:, mask.shape[1] - width :]  # (B, T')
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        index = order.to(layer.keys.device)[:, None, :, None]
        keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
        values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
        layer.reset()
        layer.update(keys, values)
    return valid.gather(1, order).to(mask.dtype)


# Free slots each regeneration cache layer keeps: a regrowth (one copy of the layer) every this many steps.
RESERVED_SLOTS = 128


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values (B, H, T, D) are views of buffers with `reserve` free slots.

    `DynamicLayer.update` concatenates, copying the whole layer at every decoding step: on a 2-core
    CPU core, 32 rows of ~700 cached tokens spend 48 ms per SmolLM2 step in those copies (a whole step of
    32 rows over 400 cached tokens measured 150 ms). Here a
    step writes into the free slots and the buffers are regrown (by `reserve` slots) only when full;
    selecting rows keeps the free slots. Anything else that replaces `keys`/`values` (crop, reset,
    offloading) works as in `DynamicLayer`: the next update simply copies once into a new buffer.
    """

    def __init__(self, reserve: int = RESERVED_SLOTS):
        if reserve < 1:
            raise ValueError(f"reserve must be a positive number of slots, got {reserve}.")
        self.reserve = reserve
        self.key_buffer = self.value_buffer = None  # (B, H, capacity, D)
        super().__init__()

    def holds_current_states(self) -> bool:
        """Whether `keys`/`values` are still the leading slots of the buffers (not replaced since)."""
        return self.key_buffer is not None and all(
            states.dim() == 4
            and states.data_ptr() == buffer.data_ptr()
            and states.stride() == buffer.stride()
            and states.shape[0] == buffer.shape[0]
            for states, buffer in ((self.keys, self.key_buffer), (self.values, self.value_buffer))
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        if not self.holds_current_states() or length + new > self.key_buffer.shape[2]:
            capacity = length + new + self.reserve
            self.key_buffer = key_states.new_empty(*key_states.shape[:2], capacity, key_states.shape[3])
            self.value_buffer = value_states.new_empty(*value_states.shape[:2], capacity, value_states.shape[3])
            if length:
                self.key_buffer[:, :, :length] = self.keys
                self.value_buffer[:, :, :length] = self.values
        self.key_buffer[:, :, length : length + new] = key_states
        self.value_buffer[:, :, length : length + new] = value_states
        self.keys = self.key_buffer[:, :, : length + new]
        self.values = self.value_buffer[:, :, : length + new]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.holds_current_states():
            return super().batch_select_indices(indices)
        length = self.get_seq_length()
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        super().reset()


def reserved_cache(model: PreTrainedModel, reserve: int = RESERVED_SLOTS) -> DynamicCache:
    """A `DynamicCache` for `model` whose full-attention layers are `ReservedLayer`s."""
    cache = DynamicCache(config=model.config)
    cache.layers = [ReservedLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def left_pad_cache(cache: DynamicCache, width: int) -> None:
    """Grow every layer of `cache` to `width` slots by zero slots on the left (keys/values (B, H, T, D))."""
    for layer in cache.layers:
        missing = width - layer.keys.shape[2]
        if missing > 0:
            pad = layer.keys.new_zeros(*layer.keys.shape[:2], missing, layer.keys.shape[3])
            keys = torch.cat([pad, layer.keys], dim=2)
            values = torch.cat(
                [pad.new_zeros(*layer.values.shape[:2], missing, layer.values.shape[3]), layer.values], 2
            )
            layer.reset()
            layer.update(keys, values)


def merge_caches(
    cache: DynamicCache, mask: torch.Tensor, other: DynamicCache, other_mask: torch.Tensor
) -> torch.Tensor:
    """Append `other`'s rows to `cache` (in place), left-padding the shorter one; returns the merged mask.

    mask (B, T), other_mask (B', T'): 1 on real slots. Returns (B + B', max(T, T')).
    """
    width = max(mask.shape[1], other_mask.shape[1])
    left_pad_cache(cache, width)
    left_pad_cache(other, width)
    for layer, extra in zip(cache.layers, other.layers):
        keys, values = torch.cat([layer.keys, extra.keys]), torch.cat([layer.values, extra.values])
        layer.reset()
        layer.update(keys, values)

    def pad(m: torch.Tensor) -> torch.Tensor:
        return torch.cat([m.new_zeros(m.shape[0], width - m.shape[1]), m], dim=1)

    return torch.cat([pad(mask), pad(other_mask)])
