"""The step's slots of a PagedKVCache: where each row's new K/V go and where its context is read from, per group.

A slot is block * block_size + offset. Per group (full attention, or one window size) and step:
    write [B, T]     slots of the step's positions; -1 for left padding (not stored)
    read  [B, L]     slots of every position so far: kept between steps and only extended, unless the block tables
                     changed under them (a new request, beams, forks, crops, copies, window frees), then rebuilt
    strided          (first slot, row stride) when the rows are consecutive slot runs at one stride: written and read
                     as views of the storage, no slot tables at all
    pages [B, n]     the blocks of each row's logical positions, when every row's padding is whole blocks: whole
                     pages are gathered per head instead of slot by slot
A steady decode step (same rows, tables and pools; the last write's block holds the new position) only adds 1 to last
step's write slots.
"""

from __future__ import annotations

import torch

from .block_pool import NULL_BLOCK


class SlotPlan:
    """The slot tables of the step in flight, per group, and the indices kept between steps."""

    def __init__(self, block_size: int, groups: list):
        self.block_size, self.groups = block_size, groups
        self.write: dict = {}  # group -> [B, T]
        self.write_all_valid: dict = {}  # group -> no row writes a padding position this step
        self.write_flat: dict = {}  # group -> the write slots flattened [B * T]
        self.read: dict = {}  # group -> [B, capacity]
        self.read_len: dict = {}  # group -> positions whose read slots are valid in self.read[group]
        self.read_index: dict = {}  # group -> this step's read slots [B, L] flattened to [B * L]
        self.pages: dict = {}  # group -> [B, n] blocks of each row's logical positions (rows aligned to blocks)
        self.gather_index: dict = {}  # (group, heads, num_blocks, kind) -> the storage gather index of this step
        self.strided: dict = {}  # group -> (first slot, row stride) when the rows are read as a view, else None
        self.version = -1  # the manager's version the kept read slots were built against
        self.steady_from = -1  # the position the last decode step wrote, when the next may reuse its slots

    def lay_out(self, rows, manager, blocks: int, padding_storable: bool) -> None:
        """Runs of `blocks` blocks side by side for a new request's rows (before anything is stored), each run
        starting with the row's whole blocks of padding; a row whose padding ends inside a block then stores that
        block's padding too, so that its positions start at a block boundary of its run (not under the block-table
        kernels, which read every stored position as visible: padding_storable False)."""
        bs = self.block_size
        if any(row.pad % bs for row in rows) and not padding_storable:
            return
        if manager.reserve_runs([row.id for row in rows], blocks, [row.pad // bs for row in rows]):
            for row in rows:
                if row.pad % bs:
                    row.pad, row.tokens = row.pad - row.pad % bs, []

    def forget(self) -> None:
        """The rows or their tables changed: the kept read slots are rebuilt at the next step."""
        self.read.clear()
        self.steady_from = -1

    def steady(self, start: int, rows, version: int) -> bool:
        """Whether this decode step changes nothing but one slot per row: the rows, tables and pools are those of the
        last step, which wrote position start - 1 of every row in the same block that position `start` falls in
        (so no block is allocated, copied or freed: the last write made that block the row's own)."""
        bs = self.block_size
        return (
            self.version == version
            and self.steady_from == start - 1
            and self.groups == [None]
            and all((start - row.pad) % bs for row in rows)
        )

    def advance(self, start: int) -> None:
        """The steady decode step's slots: each row's write slot is last step's + 1 (the same block)."""
        self.steady_from = start
        if self.strided[None] is not None:
            return  # read and written through views of the storage: no slot tables
        write = self.write[None] + 1
        buffer = self.read[None]
        if buffer.shape[1] <= start:  # doubling: amortized O(1) per decoded position
            buffer = self.read[None] = torch.cat((buffer, torch.empty_like(buffer)), dim=1)
        buffer[:, start] = write[:, 0]
        self.write[None], self.write_flat[None] = write, write.view(-1)
        self.read_len[None] = start + 1
        if self.pages.get(None) is None:  # slot by slot: the read index and the gather index grow by a position
            self.read_index[None] = buffer[:, : start + 1].reshape(-1)
            self.gather_index.clear()

    def plan(self, rows, manager, start: int, new: int, device) -> None:
        """Every group's slots for positions [start, start + new) after the manager allocated their blocks."""
        self.steady_from = -1
        if self.version != manager.version:  # tables changed under the kept read slots
            self.forget()
            self.version = manager.version
        for group in self.groups:
            self._update(group, rows, manager, start, new, device)
        if new == 1 and self.write_all_valid.get(None, False):
            self.steady_from = start  # the next decode step may take the steady path

    def _update(self, group, rows, manager, start: int, new: int, device) -> None:
        """Slots of this step for one group: write [B, new] and read [B, start + new] (module docstring)."""
        tables = [manager.table(row.id, group) for row in rows]
        self.strided[group] = layout = self._strided_layout(rows, tables, start + new)
        if layout is not None:  # written and read through views of the storage: no read slots
            # a row's padding inside its first block is written slot by slot (the view would write its
            # unstored leading positions too)
            self.write_all_valid[group] = all(start >= row.pad for row in rows)
            if not self.write_all_valid[group]:
                write = self._slots(rows, tables, start, start + new).to(device)
                self.write[group], self.write_flat[group] = write, write.view(-1)
            self.read.pop(group, None)  # rebuilt from the tables if the layout ever breaks
            self.read_len.pop(group, None)
            self.pages[group] = None
            return
        end = start + new
        buffer = self.read.get(group)  # [B, capacity]: slots of positions [0, self.read_len[group]) are valid
        rebuilt = buffer is None or buffer.shape[0] != len(rows) or self.read_len.get(group) != start
        if rebuilt:
            buffer = torch.empty((len(rows), max(2 * end, 64)), dtype=torch.long, device=device)
            buffer[:, :start] = self._slots(rows, tables, 0, start).clamp(min=0)
        elif buffer.shape[1] < end:  # doubling: amortized O(1) per decoded position
            buffer = torch.cat((buffer, torch.empty_like(buffer)), dim=1)
        write = self._slots(rows, tables, start, end).to(device)
        self.write[group], self.write_flat[group] = write, write.view(-1)
        if new == 1:  # a decode step: a row writes a padding position only if it is all padding so far
            self.write_all_valid[group] = all(start >= row.pad for row in rows)
        else:
            self.write_all_valid[group] = bool((write >= 0).all())
        buffer[:, start:end] = write if self.write_all_valid[group] else write.clamp(min=0)
        self.read[group], self.read_len[group] = buffer, end
        self.read_index[group] = buffer[:, :end].reshape(-1)  # one flat index for every layer of the group this step
        self.gather_index = {key: index for key, index in self.gather_index.items() if key[0] != group}
        self.pages[group] = None
        if all(row.pad % self.block_size == 0 for row in rows):  # every row's pages start at a logical block
            self.pages[group] = self._page_table(rows, tables, end, device)

    def _strided_layout(self, rows, tables, end: int) -> tuple[int, int] | None:
        """(first slot, row stride in slots) when row r's logical positions [0, end) are the consecutive slots from
        first + r * stride: its stored blocks consecutive, its whole blocks of left padding just before them (read,
        never written: masked, and unused by anyone else while the rows are laid out). One row alone, or rows laid
        out by reserve_runs; the rows are then read as one view of the storage. None otherwise."""
        bs, n, starts = self.block_size, -(-end // self.block_size), []
        for row, full in zip(rows, tables):
            lead = row.pad // bs
            table = full[: n - lead]
            if row.pad % bs or not table or table[0] < lead or table != list(range(table[0], table[0] + n - lead)):
                return None
            starts.append(table[0] - lead)
        stride = starts[1] - starts[0] if len(starts) > 1 else 0
        if stride < 0 or any(v != starts[0] + r * stride for r, v in enumerate(starts)):
            return None
        return starts[0] * bs, stride * bs

    def _page_table(self, rows, tables, end: int, device) -> torch.Tensor:
        """[B, n] blocks holding logical positions [k * bs, (k + 1) * bs) of each row (n * bs >= end; left padding
        and positions past a row's table read the null block). Rows' padding must be whole blocks."""
        bs = self.block_size
        width = -(-end // bs)
        pages = []
        for row, full in zip(rows, tables):
            table = [NULL_BLOCK] * (row.pad // bs) + full
            pages.append(table[:width] + [NULL_BLOCK] * (width - len(table)))
        return torch.tensor(pages, dtype=torch.long, device=device)

    def _slots(self, rows, tables, start: int, end: int) -> torch.Tensor:
        """[B, end - start] slot ids of positions [start, end) of every row; -1 for left padding."""
        bs = self.block_size
        if end - start == 1:  # a decode step: plain integer arithmetic beats a dozen tiny tensor ops
            slots = []
            for row, table in zip(rows, tables):
                stored = start - row.pad
                slots.append([table[stored // bs] * bs + stored % bs if stored >= 0 else -1])
            return torch.tensor(slots, dtype=torch.long)
        positions = torch.arange(start, end)
        out = []
        for row, full in zip(rows, tables):
            table = torch.tensor(full or [NULL_BLOCK], dtype=torch.long)
            stored = positions - row.pad
            index = stored.clamp(min=0)
            slots = table[(index // bs).clamp(max=len(table) - 1)] * bs + index % bs
            out.append(torch.where(stored >= 0, slots, -1))
        return torch.stack(out) if out else torch.empty(0, end - start, dtype=torch.long)

    def store(self, storage, group, start: int, keys: torch.Tensor, values: torch.Tensor):
        """Write one layer's keys [B, H_k, T, d_k], values [B, H_v, T, d_v] at this step's slots; the layer's K/V
        views [B, H, L + T, d] when the rows are strided (nothing to gather), else None."""
        if self.strided[group] is not None and self.write_all_valid[group]:  # views in and out
            return storage.append_strided(*self.strided[group], start, keys, values)
        if self.write_all_valid[group]:  # [B, H, T, d] -> [H, B * T, d] at the flat write slots
            storage.write(
                self.write_flat[group], keys.transpose(0, 1).flatten(1, 2), values.transpose(0, 1).flatten(1, 2)
            )
        else:  # prefill with left padding: padded positions are not stored
            valid = self.write[group].view(-1) >= 0
            storage.write(
                self.write_flat[group][valid],
                keys.transpose(0, 1).flatten(1, 2)[:, valid],
                values.transpose(0, 1).flatten(1, 2)[:, valid],
            )
        return None

    def gather(self, storage, group, batch: int, length: int):
        """K [B, H, L, d_k], V [B, H, L, d_v] of one layer's first `length` positions."""
        layout = self.strided[group]
        if layout is not None:
            return storage.strided(*layout, batch, length)
        pages = self.pages.get(group)
        key = (group, storage.heads, storage.num_blocks, pages is not None)
        index = self.gather_index.get(key)
        if pages is not None:  # rows aligned to blocks: whole pages
            if index is None:
                index = self.gather_index[key] = storage.page_index(pages)
            return storage.read_pages(index, batch, length)
        if index is None:
            index = self.gather_index[key] = storage.slot_index(self.read_index[group])
        return storage.read_slots(index, batch, length)
