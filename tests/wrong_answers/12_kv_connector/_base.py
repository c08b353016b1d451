"""A correct host store and host-tier connector that the wrong answers here change one method of (not a wrong answer itself)."""
from collections import OrderedDict

import torch

from minipaged.kv_connector import full_block_hashes, gather_blocks, host_capacity_blocks, scatter_blocks


class GoodStore:
    def __init__(self, capacity):
        self.capacity, self.num_evictions = capacity, 0
        self.slot_of, self.free_slots = OrderedDict(), list(range(capacity))

    def __contains__(self, h):
        return h in self.slot_of

    def __len__(self):
        return len(self.slot_of)

    def get(self, h):
        slot = self.slot_of.get(h)
        if slot is not None:
            self.slot_of.move_to_end(h)
        return slot

    def free_slot(self):
        return self.free_slots.pop(0)

    def evict(self):
        self.num_evictions += 1
        return self.slot_of.popitem(last=False)[1]

    def put(self, h):
        if h in self.slot_of:
            self.slot_of.move_to_end(h)
            return self.slot_of[h]
        slot = self.free_slot() if self.free_slots else self.evict()
        self.slot_of[h] = slot
        return slot


class GoodConnector:
    store_cls = GoodStore

    def __init__(self, layout, config=None, capacity_blocks=None):
        if capacity_blocks is None:
            capacity_blocks = host_capacity_blocks(layout, config.kv_offloading_size)
        self.block_size = layout.block_size
        self.store = self.store_cls(capacity_blocks)
        self.data = torch.empty((capacity_blocks, *layout.block_shape), dtype=layout.dtype)
        self.hashes, self.loads = {}, []

    def _hashes(self, seq):
        return full_block_hashes(seq.token_ids, self.block_size, self.hashes.setdefault(seq.seq_id, []))

    def first_block(self, num_computed_tokens):
        return num_computed_tokens // self.block_size

    def usable_blocks(self, seq):
        return (seq.num_tokens - 1) // self.block_size

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        hashes, n = self._hashes(seq), 0
        for i in range(self.first_block(num_computed_tokens), self.usable_blocks(seq)):
            if hashes[i] not in self.store:
                break
            n += 1
        return n * self.block_size

    def my_blocks(self, block_ids, n):
        return range(len(block_ids) - n, len(block_ids))

    def update_state_after_alloc(self, seq, block_ids, num_external_tokens):
        hashes = self._hashes(seq)
        for i in self.my_blocks(block_ids, num_external_tokens // self.block_size):
            self.loads.append((self.store.get(hashes[i]), block_ids[i]))

    def request_finished(self, seq):
        self.hashes.pop(seq.seq_id, None)

    def start_load_kv(self, kv_cache):
        if self.loads:
            scatter_blocks(kv_cache, [b for _, b in self.loads], self.data[[s for s, _ in self.loads]])
            self.loads = []

    def filled(self, sch):
        end = min(sch.start + sch.num_new_tokens, sch.seq.num_tokens)
        return range(sch.start // self.block_size, end // self.block_size)

    def save_kv(self, kv_cache, scheduled):
        for sch in scheduled:
            hashes = self._hashes(sch.seq)
            for i in self.filled(sch):
                if hashes[i] in self.store:
                    self.store.get(hashes[i])
                    continue
                self.data[self.store.put(hashes[i])] = gather_blocks(kv_cache, [sch.seq.block_table.blocks[i]])[0]
