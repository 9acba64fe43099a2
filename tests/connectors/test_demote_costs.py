"""What a Demote costs others, and what it costs the engine (issue 53, where
the router's Demote at a task's end made resumed turns slower).

Real parts, as ``SessionTierSpec`` builds them: vLLM's CPU primary tier with
``SessionCachePolicy``, the tier manager and its Mover, a ``DiskTier`` G3.

- One session's Demote ended every other owner's hold on its chunks: an
  ending task demoted the shared document the running tasks Retained.
- A Demote of chunks that write-through had stored in G3 sealed each again
  (a MAC over the whole chunk, on the engine's core) before finding it there.
"""

import pytest
from test_storage_events import Stack, disk

from sessionkv.hints import Action, Status


@pytest.fixture
def stack(tmp_path):
    s = Stack(disk(tmp_path / "g3"))
    yield s
    s.close()


def test_a_demote_leaves_what_another_owner_holds(stack):
    doc = stack.fill(4, tag="doc")  # a shared document, in session s's chain
    own = stack.fill(4, tag="own")  # s's own turns
    policy = stack.g2.policy
    with stack.m.lock:
        assert policy.retain(doc, 1, None, "another-session") == 4
    assert stack.hint(Action.DEMOTE).status is Status.ACCEPTED
    with stack.m.lock:
        first = [k for k, _ in policy.evict(4, set())]
    # s's own chunks go first; the document keeps its place and its hold.
    assert set(first) == set(own), first
    with stack.m.lock:
        assert policy.release_retains("another-session") == 4


def test_a_demote_of_chunks_in_g3_already_seals_nothing(stack):
    keys = stack.fill(4)
    assert stack.hint(Action.SHARE).status is Status.ACCEPTED  # now in G3, as written through
    sealed = []
    layout = stack.g3._layout
    seal = layout.seal

    def counting(name, chunk):
        sealed.append(name)
        return seal(name, chunk)

    layout.seal = counting
    assert stack.hint(Action.DEMOTE).status is Status.ACCEPTED
    assert sealed == []
    # A chunk G3 lacks is still sealed and stored.
    more = stack.fill(2, tag="new")
    assert stack.hint(Action.DEMOTE).status is Status.ACCEPTED
    assert sorted(sealed) == sorted(stack.g3.name(k) for k in more)
    assert stack.g3.listed(keys + more) == [True] * 6
