"""The result buffer pool never hands out a buffer that anything still references."""

import gc

import numpy as np
import torch

import mirrored
from mirrored._src.comm.buffers import BufferPool

SHAPE = (1 << 19,)  # 2 MiB of float32: above the pooling threshold
CPU = torch.device("cpu")


def test_reuses_a_dropped_buffer():
    pool = BufferPool()
    first = pool.empty(SHAPE, torch.float32, CPU)
    address = first.data_ptr()
    del first
    gc.collect()
    assert pool.empty(SHAPE, torch.float32, CPU).data_ptr() == address


def test_never_reuses_a_held_tensor_view_storage_or_array():
    pool = BufferPool(max_per_key=8)
    held = pool.empty(SHAPE, torch.float32, CPU)
    view_base = pool.empty(SHAPE, torch.float32, CPU)
    view = view_base[10:20]
    del view_base
    array_base = pool.empty(SHAPE, torch.float32, CPU)
    array = array_base.numpy()
    del array_base
    storage_base = pool.empty(SHAPE, torch.float32, CPU)
    storage = storage_base.untyped_storage()
    del storage_base
    saved_base = pool.empty(SHAPE, torch.float32, CPU)
    saved_address = saved_base.data_ptr()
    w = torch.ones(SHAPE, requires_grad=True)
    product = w * saved_base  # autograd saves saved_base for w's gradient
    del saved_base
    taken = [held.data_ptr(), view.data_ptr() - 40, array.ctypes.data, storage.data_ptr(),
             saved_address]
    assert len(set(taken)) == 5
    fresh = pool.empty(SHAPE, torch.float32, CPU)
    assert fresh.data_ptr() not in taken
    assert product.grad_fn is not None


def test_small_tensors_are_not_pooled():
    pool = BufferPool()
    small = pool.empty((4,), torch.float32, CPU)
    assert small.shape == (4,)
    assert pool.nbytes == 0  # nothing kept, so nothing can be handed out twice
    pool.empty(SHAPE, torch.float32, CPU)
    assert pool.nbytes == 2 << 20


def test_the_pool_keeps_at_most_its_byte_cap_and_empties_on_clear():
    pool = BufferPool(max_bytes=5 << 20)
    for length in range(1 << 19, (1 << 19) + 6):  # six keys of about 2 MiB, all dropped
        pool.empty((length,), torch.float32, CPU)
    assert 0 < pool.nbytes <= 5 << 20
    pool.clear()
    assert pool.nbytes == 0
    held = pool.empty(SHAPE, torch.float32, CPU)
    with torch.inference_mode():
        other = pool.empty(SHAPE, torch.float32, CPU)  # never the same buffer as outside
    assert other.data_ptr() != held.data_ptr() and other.is_inference()


def test_reduce_results_are_not_overwritten_while_held():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    parts = [torch.full(SHAPE, 1.0), torch.full(SHAPE, 2.0)]
    first = strategy.reduce("SUM", mirrored.PerReplica(parts))
    keep_view = strategy.reduce("SUM", mirrored.PerReplica(parts))[:5]
    keep_array = np.asarray(strategy.reduce("SUM", mirrored.PerReplica(parts)))
    for _ in range(4):
        strategy.reduce("SUM", mirrored.PerReplica([torch.zeros(SHAPE), torch.zeros(SHAPE)]))
    assert bool((first == 3.0).all())
    assert keep_view.tolist() == [3.0] * 5
    assert bool((keep_array == 3.0).all())


def test_closing_one_strategy_keeps_the_pool_of_another():
    from mirrored._src.comm.buffers import default_pool

    pool = default_pool()
    users = pool.users
    a = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    b = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    assert pool.users == users + 2
    parts = mirrored.PerReplica([torch.full(SHAPE, 1.0), torch.full(SHAPE, 2.0)])
    ptr = a.reduce("SUM", parts).data_ptr()  # the result is dropped: back in the pool
    held = pool.nbytes
    assert held >= 2 << 20
    b.close()
    b.close()  # closing twice releases once
    assert pool.users == users + 1
    assert pool.nbytes == held  # b's close left a's buffers alone
    again = a.reduce("SUM", parts)
    assert again.data_ptr() == ptr and bool((again == 3.0).all())
    del again
    a.close()
    assert pool.users == users
    if users == 0:
        assert pool.nbytes == 0  # the last strategy out empties it


def test_a_buffer_shared_with_another_process_is_never_reused():
    # torch.multiprocessing moves a tensor it sends into shared memory, where the
    # receiving process reads it after the sender dropped it.
    pool = BufferPool()
    sent = pool.empty(SHAPE, torch.float32, CPU)
    sent.fill_(1.0)
    sent.share_memory_()
    address = sent.data_ptr()
    del sent
    gc.collect()
    again = pool.empty(SHAPE, torch.float32, CPU)
    assert again.data_ptr() != address
    assert pool.nbytes == again.numel() * again.element_size()  # the shared one is gone
    del again
    gc.collect()
    assert pool.empty(SHAPE, torch.float32, CPU).data_ptr() != address


def test_never_reuses_a_buffer_with_autograd_history():
    pool = BufferPool()
    taken = pool.empty(SHAPE, torch.float32, CPU)
    address = taken.data_ptr()
    taken[:4].copy_(torch.ones(4, requires_grad=True))  # the buffer now has a grad_fn
    assert taken.requires_grad
    del taken
    gc.collect()
    fresh = pool.empty(SHAPE, torch.float32, CPU)
    assert fresh.data_ptr() != address and not fresh.requires_grad
