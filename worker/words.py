"""Counts in messages, with their nouns agreeing: "1 program", "2 programs", "1 entry"."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """The count and its noun, singular for 1 and plural otherwise ("0 entries").

    The plural is `plural` if given, else the noun with "ies" for a "y" after
    a consonant (entry, entries) and "s" for the rest (program, programs).
    """
    if count == 1:
        return f"{count} {noun}"
    if plural is None:
        consonant_y = noun.endswith("y") and noun[-2:-1] not in ("a", "e", "i", "o", "u")
        plural = noun[:-1] + "ies" if consonant_y else noun + "s"
    return f"{count} {plural}"


def agreeing(count: int, singular: str, plural: str) -> str:
    """The singular for a count of 1, else the plural: the verb of a count ("was", "were")."""
    return singular if count == 1 else plural
