"""A small synthetic mailbox, generated from a seed and searched through SQLite FTS5.

Each mailbox holds `MAILBOX_SIZE` short emails: some carry one fact (an order number, an
invoice amount, a meeting time, a booking code) and several distractors share their kind,
so the right email has to be found by its sender, item or city; the rest is noise. One
email of the mailbox is the target of the question. Everything is reproducible from the
seed, and the answer is a single token-like fact that code can check.
"""

from __future__ import annotations

import functools
import random
import re
import sqlite3
import string
import threading
from dataclasses import dataclass
from datetime import date, timedelta

MAILBOX_SIZE = 30
"""Emails per mailbox."""
SEARCH_LIMIT = 3
"""Most hits `Mailbox.search` returns."""

NAMES = ["Dana", "Omar", "Priya", "Lukas", "Mei", "Carlos", "Ingrid", "Tomas", "Aisha", "Felix", "Nora", "Kenji"]
COMPANIES = ["Acme", "Globex", "Initech", "Umbrella", "Hooli", "Vandelay", "Stark", "Wayne"]
ITEMS = ["laptop", "bicycle", "kettle", "backpack", "camera", "desk", "headphones", "printer"]
CITIES = ["Lisbon", "Oslo", "Denver", "Kyoto", "Dublin", "Cairo", "Lima", "Zurich"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
NOISE = [
    ("Team lunch", "Pizza in the kitchen at noon, everyone is welcome."),
    ("Newsletter", "This week: ten tips for a tidy inbox."),
    ("Parking", "The north garage is closed for cleaning tomorrow."),
    ("Birthday", "Cake for Sam at four in the lounge."),
    ("Reminder", "Please update your password this month."),
    ("Survey", "Tell us how we did. It takes two minutes."),
]
KINDS = ("order", "invoice", "meeting", "booking")
PER_KIND = 6
"""Emails of each fact kind in a mailbox (one target, the rest distractors)."""


@dataclass(frozen=True)
class Email:
    """One stored email."""

    id: int
    sender: str
    date: str
    subject: str
    body: str


@dataclass(frozen=True)
class Question:
    """A question about one email of a mailbox, and the fact that answers it."""

    seed: int
    """The mailbox seed."""
    question: str
    answer: str
    email_id: int
    """The email that holds the answer."""


def _fact_email(kind: str, key: str, rng: random.Random) -> tuple[str, str, str, str, str]:
    """(sender, subject, body, question, answer) of one fact email; `key` names who or what it is about."""
    if kind == "order":
        answer = str(rng.randint(10000, 99999))
        return ("orders@shop.example", f"Your {key} order", f"Your {key} has shipped. Order number {answer}.",
                f"What is the order number of my {key}?", answer)
    if kind == "invoice":
        answer = f"${rng.randint(120, 990)}"
        return (f"billing@{key.lower()}.example", f"Invoice from {key}",
                f"The {key} invoice total is {answer}, due in 30 days.",
                f"How much is the invoice from {key}?", answer)
    if kind == "meeting":
        answer = f"{rng.randint(9, 17)}:{rng.choice(['00', '15', '30', '45'])}"
        day = rng.choice(WEEKDAYS)
        return (f"{key.lower()}@work.example", "Meeting moved",
                f"Hi, {key} here. Our meeting is moved to {day} at {answer}.",
                f"What time is the meeting with {key} now?", answer)
    answer = "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(6))
    return ("trips@travel.example", f"Hotel in {key}", f"Your hotel in {key} is booked. Booking code {answer}.",
            f"What is the booking code of my hotel in {key}?", answer)


_KEYS = {"order": ITEMS, "invoice": COMPANIES, "meeting": NAMES, "booking": CITIES}


def generate(seed: int) -> tuple[list[Email], list[Question]]:
    """The mailbox of `seed` (emails newest last) and one question per fact email."""
    rng = random.Random(seed)
    drafts = []
    for kind in KINDS:
        for key in rng.sample(_KEYS[kind], PER_KIND):
            drafts.append(_fact_email(kind, key, rng))
    while len(drafts) < MAILBOX_SIZE:
        subject, body = rng.choice(NOISE)
        drafts.append((f"{rng.choice(NAMES).lower()}@work.example", subject, body, "", ""))
    rng.shuffle(drafts)
    start = date(2024, 1, 1) + timedelta(days=rng.randrange(300))
    emails, questions = [], []
    for number, (sender, subject, body, question, answer) in enumerate(drafts, start=1):
        emails.append(Email(number, sender, (start + timedelta(days=number)).isoformat(), subject, body))
        if question:
            questions.append(Question(seed, question, answer, number))
    return emails, questions


def _terms(keywords: str) -> list[str]:
    """The words of a keyword string, safe to put in an FTS5 query."""
    return [word.lower() for word in re.findall(r"[A-Za-z0-9]+", keywords)]


class Mailbox:
    """The emails of one seed in an in-memory SQLite database with an FTS5 index."""

    def __init__(self, emails: list[Email]) -> None:
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._lock = threading.Lock()
        self._db.execute("CREATE VIRTUAL TABLE emails USING fts5(sender, date UNINDEXED, subject, body)")
        self._db.executemany(
            "INSERT INTO emails(rowid, sender, date, subject, body) VALUES (?, ?, ?, ?, ?)",
            [(e.id, e.sender, e.date, e.subject, e.body) for e in emails],
        )

    def search(self, keywords: str, limit: int = SEARCH_LIMIT) -> list[tuple[int, str, str, str]]:
        """Best matches for any of the words (BM25 order): (id, sender, date, subject)."""
        terms = _terms(keywords)
        if not terms:
            return []
        query = " OR ".join(f'"{term}"' for term in terms)
        with self._lock:
            rows = self._db.execute(
                "SELECT rowid, sender, date, subject FROM emails WHERE emails MATCH ? ORDER BY rank LIMIT ?",
                (query, limit),
            ).fetchall()
        return [(int(r[0]), str(r[1]), str(r[2]), str(r[3])) for r in rows]

    def read(self, email_id: int) -> Email | None:
        """The email with this id, or None."""
        if not 0 < email_id < 2**63:  # no such rowid; SQLite would raise OverflowError past 2**63 - 1
            return None
        with self._lock:
            row = self._db.execute(
                "SELECT rowid, sender, date, subject, body FROM emails WHERE rowid = ?", (email_id,)
            ).fetchone()
        return Email(int(row[0]), *map(str, row[1:])) if row else None


@functools.lru_cache(maxsize=256)
def mailbox(seed: int) -> Mailbox:
    """The (cached) searchable mailbox of `seed`."""
    return Mailbox(generate(seed)[0])


def questions(count: int, seed: int) -> list[Question]:
    """`count` questions, each about a different mailbox, reproducible by `seed`."""
    rng = random.Random(seed)
    return [rng.choice(generate(rng.randrange(1_000_000))[1]) for _ in range(count)]
