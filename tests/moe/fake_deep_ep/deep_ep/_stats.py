"""Call counters of the stand-in (tests assert on them: e.g. no token moved before validation raised)."""

CALLS = {
    "dispatch": 0,
    "cached_dispatch": 0,
    "combine": 0,
    "buffers": 0,
    "size_hints": 0,
    "ll_dispatch": 0,
    "ll_combine": 0,
}
