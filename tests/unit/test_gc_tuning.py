import gc
import weakref

from prime_rl.utils.gc_tuning import YOUNG_THRESHOLD, freeze_setup_objects


class Node:
    """A tracked object that can hold itself (a reference cycle only the collector frees)."""


def test_set_up_garbage_is_collected_survivors_are_never_walked_again_and_young_collections_wait():
    before = gc.get_threshold()
    kept = Node()
    cycle = Node()
    cycle.me = cycle
    cycle_gone = weakref.ref(cycle)
    del cycle
    try:
        frozen = freeze_setup_objects()
        assert cycle_gone() is None  # collected before the freeze, not kept forever
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # no generation holds it: no collection walks it
        assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
        later = Node()
        assert any(o is later for o in gc.get_objects())  # what the steady state makes is still collected
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
