"""Keep Python's cyclic garbage collector off what a rollout process set up once, and off each step's short-lived
objects.

After set-up the orchestrator holds ~450k objects the collector tracks (verifiers, the environments and their
datasets, tokenizers, pydantic schemas), and they live as long as the process. A full collection walks every one of
them: 0.25-0.30 s with the event loop stopped and every rollout waiting, 8-9 times in 30 steps of the demo. Frozen
(`gc.freeze`), they are never walked again: a full collection then took ~15 ms (`gc.callbacks`, 2026-11-28).

The rollouts of a step allocate and drop tens of thousands of containers (messages, pydantic models, HTTP objects).
Python collects its youngest generation after 700 net allocations: ~41 times a step, 1.0-1.1 s of collections per
30 steps, most of them walking the rollouts still in flight. Refcounting frees nearly all of those objects anyway:
at `YOUNG_THRESHOLD` the youngest generation was not collected once in 40 steps (net growth ~27k objects).
"""

import gc

YOUNG_THRESHOLD = 50_000
"""Net allocations of tracked objects before the youngest generation is collected (Python's default: 700). A
collection then walks at most this many young objects; what only the collector can free (reference cycles) waits
for it, at most this many objects (tens of MiB)."""


def freeze_setup_objects() -> int:
    """Collect what set-up left behind, exempt every surviving object from later collections, and raise the youngest
    generation's threshold. Call once, when set-up is done and before the steady state; returns the objects frozen."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
    return gc.get_freeze_count()
