"""Which slot's prefix a new context starts from, and where a displaced prefix goes."""

from workers.engine.prefixes import MIN_COPIED, Prefixes, Reuse

SYSTEM = list(range(1000, 1000 + MIN_COPIED + 4))


def test_the_longest_prefix_short_of_the_last_token() -> None:
    prefixes = Prefixes(4)
    prefixes.keep(1, "a", [*SYSTEM, 1, 2, 3])
    prefixes.keep(2, "a", [*SYSTEM, 1, 2, 3, 4, 5])
    assert prefixes.best(0, "a", [*SYSTEM, 1, 2, 3, 4, 9]) == Reuse(2, len(SYSTEM) + 4)
    # the whole context held: its last token is computed again, for its logits
    assert prefixes.best(0, "a", [*SYSTEM, 1, 2, 3]) == Reuse(1, len(SYSTEM) + 2)


def test_its_own_slot_wins_a_tie_and_needs_no_minimum() -> None:
    prefixes = Prefixes(3)
    prefixes.keep(0, "a", [7, 8, 9])
    prefixes.keep(1, "a", [7, 8, 9])
    assert prefixes.best(0, "a", [7, 8, 9, 10]) == Reuse(0, 3)
    assert prefixes.best(2, "a", [7, 8, 9, 10]) is None  # 3 tokens are not worth a copy
    prefixes.keep(1, "a", SYSTEM)
    prefixes.keep(0, "a", SYSTEM)
    assert prefixes.best(0, "a", [*SYSTEM, 5]) == Reuse(0, len(SYSTEM))


def test_prefixes_are_shared_only_within_a_scope() -> None:
    prefixes = Prefixes(2)
    prefixes.keep(1, "alice", SYSTEM)
    assert prefixes.best(0, "bob", [*SYSTEM, 5]) is None
    assert prefixes.best(0, "alice", [*SYSTEM, 5]) == Reuse(1, len(SYSTEM))


def test_a_displaced_prefix_goes_to_an_empty_slot_else_over_the_least_recently_used() -> None:
    prefixes = Prefixes(4)
    prefixes.keep(0, "a", [*SYSTEM, 0, 0])
    assert prefixes.spare(0, [1, 2, 3]) == 3  # empty ones first
    prefixes.keep(1, "a", [*SYSTEM, 1])
    prefixes.keep(2, "a", [*SYSTEM, 2])
    prefixes.keep(3, "a", [*SYSTEM, 3])
    prefixes.best(1, "b", [1])  # nothing in scope b: touches nothing
    assert prefixes.spare(1, [0, 2, 3]) == 0
    assert prefixes.best(3, "a", [*SYSTEM, 0, 0, 5]) == Reuse(0, len(SYSTEM) + 2)  # slot 0 used now
    assert prefixes.spare(3, [0, 1, 2]) == 1
    assert prefixes.spare(1, [0, 2, 3]) is None  # every other prefix was used more recently
    prefixes.keep(2, "a", [1, 2])
    assert prefixes.spare(2, [0, 1, 3]) is None  # too short to be worth a copy


def test_a_prefix_reused_in_its_own_slot_is_moved_aside_only_for_what_would_be_lost() -> None:
    prefixes = Prefixes(3)
    prefixes.keep(0, "a", [*SYSTEM, *range(MIN_COPIED)])
    # the new sequence keeps all but MIN_COPIED - 1 of its tokens in place: computing those is cheaper
    assert prefixes.spare(0, [1, 2], kept=len(SYSTEM) + 1) is None
    assert prefixes.spare(0, [1, 2], kept=len(SYSTEM)) == 2
