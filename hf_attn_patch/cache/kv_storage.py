"""KVStorage: one attention layer's paged K/V, head-major: keys [H, slots, d_k] and values [H, slots, d_v].

With d_k == d_v (GQA) both live in one tensor [2H, slots, d] (keys rows 0..H-1, values H..2H-1), so one gather and
one scatter serve both; otherwise two tensors.

A slot is block * block_size + offset; block 0 is the null block (zeros, always masked). Head-major with keys and
values apart, so that every read hands attention [B, H, L, d] whose per-(row, head) [L, d] matrices are contiguous,
which CPU SDPA reads as fast as a dense cache (a token-major [slots, H, d_k + d_v] layout costs it ~10% on small
heads, each head's row strided by H * (d_k + d_v)):
- rows stored in consecutive slots at one stride (one row, or a batch laid out by KVManager.reserve_runs) read as
  a view, `strided(first, stride, batch, length)`, with no copy;
- a batch reads with one gather of whole pages per head and tensor: row h * num_blocks + block of the
  [H * num_blocks, block_size * d] view (`read_pages`, index from `page_index`);
- the kernels get flat strided views [slots, H, d] (`key_cache`, `value_cache`): slot stride d, head stride
  slots * d, each head's page contiguous.
A layer whose CacheSpec (variants.py) says `fused` keeps [key | value] in one tensor [H, slots, d_k + d_v] (MLA:
H = 1, [c | k_rope]), so a latent decode kernel reads a token's row at once (`rows`); `keys`/`values` are its
slices (d_v may be 0: a latent cached once, nothing beside it).
"""

from __future__ import annotations

import torch


class KVStorage:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        heads: int,
        key_dim: int,
        value_dim: int,
        like: torch.Tensor,
        fused: bool = False,
    ):
        self.block_size, self.heads, self.key_dim, self.value_dim, self.fused = (
            block_size,
            heads,
            key_dim,
            value_dim,
            fused,
        )
        slots = num_blocks * block_size
        self.paired = not fused and key_dim == value_dim
        if fused:
            self._tensors = (like.new_zeros((heads, slots, key_dim + value_dim)),)
        elif self.paired:
            self._tensors = (like.new_zeros((2 * heads, slots, key_dim)),)
        else:
            self._tensors = (like.new_zeros((heads, slots, key_dim)), like.new_zeros((heads, slots, value_dim)))
        self._views()

    def _views(self) -> None:
        if self.fused:
            (both,) = self._tensors
            self.keys, self.values = both[..., : self.key_dim], both[..., self.key_dim :]
        elif self.paired:
            (both,) = self._tensors
            self.keys, self.values = both[: self.heads], both[self.heads :]
        else:
            self.keys, self.values = self._tensors
        self.num_blocks = self._tensors[0].shape[1] // self.block_size
        k, v = self.keys, self.values  # (head stride, slot stride, offset) of each: what `strided` views need
        self._geometry = (k.stride(0), k.stride(1), k.storage_offset(), v.stride(0), v.stride(1), v.storage_offset())

    @property
    def dtype(self) -> torch.dtype:
        return self._tensors[0].dtype

    @property
    def element_size(self) -> int:
        return self._tensors[0].element_size()

    @property
    def key_cache(self) -> torch.Tensor:
        """[slots, H, d_k] (a view): the kernels' flat key pages."""
        return self.keys.transpose(0, 1)

    @property
    def value_cache(self) -> torch.Tensor:
        return self.values.transpose(0, 1)

    @property
    def rows(self) -> torch.Tensor:
        """fused only: [slots, 1, d_k + d_v] (a view), one token's [c | k_rope] per row (the MLA decode kernel)."""
        return self._tensors[0].transpose(0, 1)

    def grow(self, num_blocks: int) -> None:
        """Extend to num_blocks blocks (new ones zero); existing slots keep their contents."""
        extra = num_blocks * self.block_size - self._tensors[0].shape[1]
        if extra > 0:
            self._tensors = tuple(
                torch.cat((t, t.new_zeros((t.shape[0], extra, t.shape[2]))), 1) for t in self._tensors
            )
            self._views()

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys [H, N, d_k], values [H, N, d_v] into slots [N] (distinct)."""
        if self.fused:
            self._tensors[0].index_copy_(1, slots, torch.cat((keys, values), -1).to(self.dtype))
        else:  # paired: keys and values are the two contiguous halves of one tensor, written in place
            self.keys.index_copy_(1, slots, keys.to(self.dtype))
            self.values.index_copy_(1, slots, values.to(self.dtype))

    def strided(self, first: int, stride: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """B rows stored in consecutive slots, row r's positions [0, length) in slots first + r * stride + p ->
        K [B, H, length, d_k], V [B, H, length, d_v]: views of the storage (no copy; writing them writes it).
        (Written out per tensor: a decode step calls this once per layer, so its Python is kept minimal.)"""
        kh, ks, ko, vh, vs, vo = self._geometry
        heads, row_k, row_v = self.heads, stride * ks, stride * vs
        return (
            self.keys.as_strided((batch, heads, length, self.key_dim), (row_k, kh, ks, 1), ko + first * ks),
            self.values.as_strided((batch, heads, length, self.value_dim), (row_v, vh, vs, 1), vo + first * vs),
        )

    def append_strided(self, first: int, stride: int, start: int, keys: torch.Tensor, values: torch.Tensor):
        """Write keys [B, H, T, d_k], values [B, H, T, d_v] at positions [start, start + T) of the rows of `strided`
        and return those rows' K [B, H, start + T, d_k], V (views)."""
        kh, ks, ko, vh, vs, vo = self._geometry
        self.keys.as_strided(keys.shape, (stride * ks, kh, ks, 1), ko + (first + start) * ks).copy_(keys)
        self.values.as_strided(values.shape, (stride * vs, vh, vs, 1), vo + (first + start) * vs).copy_(values)
        return self.strided(first, stride, keys.shape[0], start + keys.shape[2])

    def page_index(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks [B, n] -> the flat page index [H * B * n] of `read_pages` (one per step, shared by the layers of
        a group with this many heads and blocks)."""
        heads = torch.arange(self._tensors[0].shape[0], device=blocks.device).view(-1, 1)
        return (heads * self.num_blocks + blocks.reshape(1, -1)).reshape(-1)

    def read_pages(self, index: torch.Tensor, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of B rows' pages (index from page_index over [B, n] blocks, n * block_size
        >= length) -> K [B, H, length, d_k], V [B, H, length, d_v] (per row and head contiguous)."""
        out = []
        for t in self._tensors:
            pages = t.view(t.shape[0] * self.num_blocks, -1).index_select(0, index)
            out.append(pages.view(t.shape[0], batch, -1, t.shape[2])[:, :, :length].transpose(0, 1))
        return self._split(out)

    def _split(self, out: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered [B, rows, L, d] of each tensor -> K [B, H, L, d_k], V [B, H, L, d_v]."""
        if self.fused:
            return out[0][..., : self.key_dim], out[0][..., self.key_dim :]
        if self.paired:
            return out[0][:, : self.heads], out[0][:, self.heads :]
        return out[0], out[1]

    def slot_index(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [B * L] (row-major) -> the flat index [H * B * L] of `read_slots`."""
        heads = torch.arange(self._tensors[0].shape[0], device=slots.device).view(-1, 1)
        return (heads * self._tensors[0].shape[1] + slots.reshape(1, -1)).reshape(-1)

    def read_slots(self, index: torch.Tensor, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """B rows of `length` slots each (index from slot_index) -> K [B, H, length, d_k], V [B, H, length, d_v]:
        one token's row per index (slower than whole pages on small heads; for rows not aligned to blocks)."""
        out = []
        for t in self._tensors:
            rows = t.reshape(-1, t.shape[2]).index_select(0, index)
            out.append(rows.view(t.shape[0], batch, length, t.shape[2]).transpose(0, 1))
        return self._split(out)

    def copy_block(self, source: int, target: int) -> None:
        bs = self.block_size
        for t in self._tensors:
            t[:, target * bs : (target + 1) * bs] = t[:, source * bs : (source + 1) * bs]

    def zero_block(self, block: int) -> None:
        bs = self.block_size
        for t in self._tensors:
            t[:, block * bs : (block + 1) * bs] = 0

    def any(self) -> bool:
        return any(bool(t.any()) for t in self._tensors)

    def block_is_zero(self, block: int) -> bool:
        bs = self.block_size
        return not any(bool(t[:, block * bs : (block + 1) * bs].any()) for t in self._tensors)


def apply_copies(copies: list[tuple], layers: list[tuple]) -> None:
    """The KV manager's copy-on-write copies [(group, source block, target block)] applied to every layer's storage:
    layers [(group, KVStorage or None)]. Block contents move before the step writes into the targets."""
    for group, source, target in copies:
        for layer_group, storage in layers:
            if storage is not None and layer_group == group:
                storage.copy_block(source, target)
