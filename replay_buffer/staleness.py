"""Staleness rule (docs/design.md §3), pure: a group whose oldest token came from `min_version` is usable by a
trainer at policy `version` iff version - min_version <= max_staleness (counted in versions)."""


def staleness(version: int, min_version: int) -> int:
    return max(0, version - min_version)


def is_usable(version: int, min_version: int, max_staleness: int) -> bool:
    return staleness(version, min_version) <= max_staleness
