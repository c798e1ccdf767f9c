"""Short synthetic news items, each carrying four key facts, drawn reproducibly from a seed.

A document is a few sentences: two that carry the facts (a person, a place, a number, a
year) and one or two of filler that carry none, so a good summary has to choose what to keep.
"""

from __future__ import annotations

import random
import re
from typing import TypedDict

FIRST_NAMES = ["Marta", "Tomas", "Aisha", "Lena", "Oskar", "Priya", "Hugo", "Nadia", "Felix", "Ines", "Rafael", "Yuki"]
SURNAMES = ["Quist", "Brandt", "Okafor", "Lindqvist", "Moreau", "Varga", "Castell", "Novak", "Haldane", "Ferreira"]
PLACES = ["Lisbon", "Tromso", "Nairobi", "Kyoto", "Valencia", "Gdansk", "Porto", "Tallinn", "Dublin", "Lyon", "Bergen"]

STORIES = [
    (
        "{person} opened a bakery in {place} in {year}.",
        "By the end of the first month it had sold {number} loaves.",
    ),
    (
        "In {year}, engineer {person} finished a new footbridge in {place}.",
        "The bridge is {number} metres long.",
    ),
    (
        "{person} led a volunteer clean-up of the river in {place} in {year}.",
        "The volunteers collected {number} bags of rubbish.",
    ),
    (
        "The city library of {place} hired {person} as its director in {year}.",
        "In the first year the library added {number} new books.",
    ),
    (
        "{person} ran the first marathon held in {place} in {year}.",
        "There were {number} runners at the start line.",
    ),
    (
        "In {year}, {person} founded a small cycling club in {place}.",
        "Today the club has {number} members.",
    ),
]
FILLER = [
    "The weather was mild for the season.",
    "Local newspapers covered the story for several days.",
    "Many residents said they were pleased.",
    "A few people had doubts at first.",
    "The mayor mentioned it in a short speech.",
    "Photos of the event were shared widely online.",
]


class Document(TypedDict):
    """One document and the facts a summary should keep."""

    text: str
    """The document, three or four sentences."""
    person: str
    """Full name of the person; a summary covers it by naming the surname."""
    place: str
    year: int
    number: int


def documents(count: int, seed: int) -> list[Document]:
    """Return `count` documents, reproducible by `seed`."""
    rng = random.Random(seed)
    out: list[Document] = []
    for _ in range(count):
        person = f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}"
        facts = {
            "person": person,
            "place": rng.choice(PLACES),
            "year": rng.randint(1990, 2023),
            "number": rng.randint(12, 950),
        }
        lead, detail = rng.choice(STORIES)
        sentences = [lead.format(**facts), detail.format(**facts)]
        for filler in rng.sample(FILLER, rng.randint(1, 2)):
            sentences.insert(rng.randint(1, len(sentences)), filler)
        out.append(Document(text=" ".join(sentences), **facts))  # type: ignore[typeddict-item]
    return out


def facts_covered(document: Document, summary: str) -> list[bool]:
    """Which of the four facts (surname, place, year, number) the summary states."""
    words = {word.lower() for word in re.findall(r"[A-Za-z]+", summary)}
    numbers = {n.lstrip("0") for n in re.findall(r"[0-9]+", summary.replace(",", ""))}  # int() raises past 4300 digits
    surname = document["person"].split()[-1].lower()
    return [
        surname in words,
        document["place"].lower() in words,
        str(document["year"]) in numbers,
        str(document["number"]) in numbers,
    ]
