import numpy as np

from sessionkv.connectors.cpu_worker import expand_chunks


def test_expand_chunks_whole_chunks():
    c, s = expand_chunks(np.array([7, 3]), blocks_per_chunk=2, skip=0, count=4)
    assert list(zip(c.tolist(), s.tolist())) == [(7, 0), (7, 1), (3, 0), (3, 1)]


def test_expand_chunks_starting_mid_chunk_and_ending_early():
    c, s = expand_chunks(np.array([5, 9, 2]), blocks_per_chunk=4, skip=3, count=6)
    assert list(zip(c.tolist(), s.tolist())) == [(5, 3), (9, 0), (9, 1), (9, 2), (9, 3), (2, 0)]
