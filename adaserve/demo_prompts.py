"""Prompts for `adaserve demo`, one list per SLO class (what each application sends)."""

from __future__ import annotations

CODING = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Implement binary search over a sorted list in Python.",
    "Write a Python function that counts the words in a sentence.",
    "Write a SQL query that returns the ten most recent orders.",
    "Write a JavaScript function that removes duplicates from an array.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a Python function that merges two sorted lists.",
    "Write a bash command that counts the lines of every .py file in a folder.",
    "Write a Python function that converts Celsius to Fahrenheit.",
]

CHAT = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "What should I pack for a weekend hiking trip?",
    "How do I make a cup of green tea?",
    "What are the benefits of regular exercise?",
    "Suggest a name for a friendly golden retriever.",
    "How many planets are in the solar system?",
    "What is a good way to learn a new language?",
    "Tell me a fun fact about octopuses.",
]

_ARTICLES = [
    "The city council voted on Tuesday to expand the bike lane network by forty "
    "kilometres over the next three years. Supporters said the plan would reduce traffic "
    "and pollution, while some shop owners worried about losing parking spaces. The first "
    "new lanes will open in the spring near the central station.",
    "Researchers at a marine institute reported that coral reefs in the northern bay "
    "showed signs of recovery after two years without major heat waves. Divers counted "
    "more young coral colonies than in any survey of the last decade, though the team "
    "warned that a single hot summer could undo the progress.",
    "A small bakery in the old town won the national bread award this year with a rye "
    "loaf made from a starter the owner's grandmother kept for fifty years. Queues now "
    "form before opening time, and the bakery has hired three new apprentices.",
    "The national weather service warned of heavy snow in the mountains this weekend. "
    "Drivers were asked to carry chains and to avoid the high passes on Saturday night, "
    "when winds are expected to be strongest. Ski resorts expect an early start.",
]
SUMMARIZE = [f"Summarize in two sentences:\n\n{a}" for a in _ARTICLES]

BY_CLASS = {"coding": CODING, "chat": CHAT, "summarize": SUMMARIZE}


def long_document(seed: int, target_words: int) -> str:
    """A summarization prompt of about `target_words` words (~1.3 tokens each for the
    embedded tokenizer): numbered news reports, the articles above in a seeded order,
    repeated until long enough. What a summarizer sends when it sends a whole document."""
    import random

    rng = random.Random(seed)
    parts, words, k = [], 0, 0
    while words < target_words:
        article = _ARTICLES[rng.randrange(len(_ARTICLES))]
        k += 1
        parts.append(f"Report {k}: {article}")
        words += len(article.split()) + 2
    body = "\n\n".join(parts)
    return f"Summarize these news reports in three sentences:\n\n{body}"


MAX_TOKENS = {"coding": 96, "chat": 64, "summarize": 48}
