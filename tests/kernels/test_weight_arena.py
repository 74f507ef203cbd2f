"""kernels/weight_arena.py: packed weights and KV tiers in 2 MiB-aligned, huge-page-advised mappings."""

from __future__ import annotations

import gc

import pytest
import torch

from kernels.weight_arena import CHUNK, HUGE_PAGE, WeightArena, huge_page_zeros


def test_tensors_are_aligned_disjoint_zeroed_and_outlive_the_arena():
    arena = WeightArena()
    sizes = [100, 4096, 3, 1 << 20, 77]
    ts = [arena.take(n) for n in sizes]
    assert [t.numel() for t in ts] == sizes and all(t.dtype == torch.uint8 for t in ts)
    assert all(t.data_ptr() % 64 == 0 for t in ts)
    assert ts[0].data_ptr() % HUGE_PAGE == 0                 # a chunk starts on a huge page
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in ts)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert all(not t.any() for t in ts)
    for i, t in enumerate(ts):
        t.fill_(i + 1)
    del arena
    gc.collect()
    assert all(bool((t == i + 1).all()) for i, t in enumerate(ts))   # the mappings live on


def test_a_request_larger_than_a_chunk_gets_its_own_mapping():
    arena = WeightArena()
    small = arena.take(1000)
    big = arena.take(CHUNK + 5)
    assert big.numel() == CHUNK + 5 and big.data_ptr() % HUGE_PAGE == 0
    big[-1] = 7                                              # the whole span is writable
    after = arena.take(10)                                   # the bump pointer moved to the new chunk
    assert not (small.data_ptr() <= after.data_ptr() < small.data_ptr() + 1000)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="positive"):
        WeightArena().take(0)


def _thp(setting: str) -> str:
    """The selected value of /sys/kernel/mm/transparent_hugepage/<setting> ('' if unreadable)."""
    try:
        text = open(f"/sys/kernel/mm/transparent_hugepage/{setting}").read()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(_thp("enabled") not in ("always", "madvise")
                    or _thp("defrag") not in ("always", "madvise", "defer+madvise"),
                    reason="transparent huge pages off, or not allocated synchronously, on this host")
def test_the_memory_is_on_huge_pages_where_the_os_allows():
    t = WeightArena().take(4 * HUGE_PAGE)
    t.fill_(1)                                               # fault it in
    assert _anon_huge_kib(t.data_ptr()) >= 2048


def test_huge_page_zeros_is_a_zeroed_tensor_of_the_shape_and_dtype():
    t = huge_page_zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0 and not t.any()
    t.fill_(2)
    assert bool((t == 2).all())
    assert huge_page_zeros((0, 4), torch.float32).shape == (0, 4)        # nothing to map


@pytest.mark.skipif(_thp("enabled") not in ("always", "madvise")
                    or _thp("defrag") not in ("always", "madvise", "defer+madvise"),
                    reason="transparent huge pages off, or not allocated synchronously, on this host")
def test_huge_page_zeros_is_on_huge_pages_where_the_os_allows():
    t = huge_page_zeros((4 * HUGE_PAGE // 4,), torch.float32)
    t.fill_(1)
    assert _anon_huge_kib(t.data_ptr()) >= 2048
