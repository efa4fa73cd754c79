"""The target cache of one `generate` call and which of its slots each row may attend to.

Rows of a batch accept different numbers of drafts, so the slots of rejected drafts become holes, masked
exactly like left padding (`mask`, (R, T)); the tail common to all rows is cropped, and the holes are
compacted when they pile up. A static cache keeps its batch (and a compiled graph its shapes): rows that
finish stay in it, idle (`cache_rows`: the cache row of each active row), and it compacts only when a round
would not fit. Batch 1 is the case where every slot is valid. After a tree round, only the accepted path's
entries stay (`keep_tree_path`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from ..caches import compact_cache, needs_compaction
from .drafting.draft_tree import DraftTree


def cache_capacity(cache) -> int:
    """The slots a static cache holds (its smallest layer's; layers without a maximum are not counted)."""
    return min(length for layer in cache.layers if (length := layer.get_max_length()) > 0)


class TargetSlots:
    """The cache, its slots' validity per active row, and (static caches) the cache row of each active row."""

    def __init__(self, cache, cache_key: str, batch_size: int, device: torch.device, pad: int = 0):
        self.cache, self.cache_key, self.batch_size, self.pad = cache, cache_key, batch_size, pad
        self.mask = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # (R, T)
        static = cache.is_compileable
        self.cache_rows = torch.arange(batch_size, device=device) if static else None
        self.capacity = cache_capacity(cache) if static else None
        # Past recording (on for rollback) keeps a sliding layer's evicted keys until a crop trims them
        self.sliding = any(type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in cache.layers)

    @property
    def length(self) -> int:
        """Slots the cache holds per row (valid or holes)."""
        return self.mask.shape[1]

    def round_inputs(self, tokens: torch.LongTensor):
        """(tokens, 2D mask, positions) of a round after the prefill over `tokens` (R, n): each row's positions
        count its valid slots. Static caches: laid out over all their rows (idle rows read pad tokens)."""
        fresh = self.mask.new_ones(tokens.shape)  # after the prefill every row's unread token is valid
        mask = torch.cat([self.mask, fresh], 1)
        positions = self.mask.sum(1, keepdim=True) + fresh.cumsum(1) - 1
        if self.cache_rows is not None:
            tokens, mask = self.all_cache_rows(tokens, self.pad), self.all_cache_rows(mask, 1)
            positions = self.all_cache_rows(positions, 0)
        return tokens, mask, positions

    def all_cache_rows(self, values: torch.Tensor, fill: int) -> torch.Tensor:
        """values (R, n) of the active rows laid out over all the static cache's rows (B, n), `fill` elsewhere."""
        if len(self.cache_rows) == self.batch_size:
            return values
        full = values.new_full((self.batch_size, values.shape[1]), fill)
        full[self.cache_rows] = values
        return full

    def active_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """A forward output over all the static cache's rows (B, ...) cut to the active rows (R, ...)."""
        if self.cache_rows is None or len(self.cache_rows) == tensor.shape[0]:
            return tensor
        return tensor[self.cache_rows]

    def fits(self, width: int) -> bool:
        """Whether a round of `width` tokens fits after the kept slots (always, unless the cache is static)."""
        return self.capacity is None or self.length + width <= self.capacity

    def make_room(self, needed: int, wanted: int) -> None:
        """Compact a static cache's holes (rejected drafts of some rows) when `wanted` more slots (a padded
        compiled round) would not fit; ValueError if even `needed` (the round itself) does not fit then."""
        if self.capacity is None or self.length + max(needed, wanted) <= self.capacity:
            return
        valid = self.all_cache_rows(self.mask, 0)  # idle rows keep nothing
        self.mask = compact_cache(self.cache, valid)[self.cache_rows]
        if self.length + needed > self.capacity:
            raise ValueError(
                f"The static cache ({self.capacity} slots) cannot hold a round of {needed} tokens after "
                f"{self.length} kept slots: pass max_cache_len >= max_length + {wanted}."
            )

    def keep(
        self, committed: torch.LongTensor, unread_mask: torch.Tensor, num_drafts: int, tree: DraftTree | None, path
    ) -> torch.Tensor:
        """Roll back a verified round: keep the slots of the unread tokens (R, u) and of each row's committed drafts
        (committed (R,) tokens, the last of them unread), drop or mask the rest; a tree keeps its accepted `path`.
        Returns the validity (R, s) of the s slots the round kept, whose features the drafter reads next."""
        if tree is not None:
            kept = int(committed[0])
            keep_tree_path(self.cache, tree.num_nodes, path[:kept])
            kept_valid = unread_mask.new_ones(1, kept)
        else:
            valid_drafts = (committed - 1).clamp_min(0).to(unread_mask.device)
            slots = torch.arange(num_drafts, device=unread_mask.device)
            kept_valid = torch.cat([unread_mask, (slots < valid_drafts[:, None]).to(unread_mask.dtype)], 1)
            used = unread_mask.shape[1] + int(valid_drafts.max())  # later slots are rejected in every row
            if used < kept_valid.shape[1]:
                self.cache.crop(used - kept_valid.shape[1])
            kept_valid = kept_valid[:, :used]
        if self.sliding:  # back to the window: crop(0) trims sliding layers only (Transformers 5.23-5.25)
            self.cache.crop(0)
        self.mask = torch.cat([self.mask, kept_valid], 1)
        return kept_valid

    def prune(self, index: torch.LongTensor | None) -> None:
        """Keep the active rows `index` (None: all); a dynamic cache drops the others and compacts its holes when
        they exceed the bound (static caches keep every row idle and compact in `make_room`)."""
        if index is not None:
            if self.cache_rows is None:
                self.cache.batch_select_indices(index)
            else:
                self.cache_rows = self.cache_rows[index]
            self.mask = self.mask[index]
        if self.cache_rows is None and needs_compaction(self.mask):
            self.mask = compact_cache(self.cache, self.mask)


def keep_tree_path(cache: Cache, num_nodes: int, keep: Sequence[int]) -> None:
    """Keep, of the `num_nodes` tree entries that end every layer of `cache`, only the nodes `keep`
    (increasing, root first), in that order; the context before the tree is untouched.

    A path that is a prefix of the layout (0, 1, ..., n) is a crop. Otherwise the kept entries are copied
    into the first len(keep) tree slots in place (O(path), not O(cache)) and the rest cropped, so the
    cache's own `crop` keeps its bookkeeping (a sliding-window layer's length) right.
    """
    keep = list(keep)
    if not keep or any(b <= a for a, b in zip(keep, keep[1:])) or keep[0] != 0 or keep[-1] >= num_nodes:
        raise ValueError(f"keep_tree_path: keep={keep} must be increasing node ids from 0 below {num_nodes}.")
    if keep != list(range(len(keep))):
        for layer in cache.layers:
            if not layer.is_initialized:
                continue
            start = int(layer.get_seq_length()) - num_nodes  # static layers: their write position
            index = torch.tensor(keep, device=layer.keys.device) + start
            layer.keys[..., start : start + len(keep), :] = layer.keys[..., index, :]
            layer.values[..., start : start + len(keep), :] = layer.values[..., index, :]
    cache.crop(-(num_nodes - len(keep)))
