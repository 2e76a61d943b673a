"""The conversations bench/speculative.py sends: answers that copy from their prompt, and open
chat whose answers do not.

Copy-heavy: what applications do with a model all day, and where prompt lookup pays: rewrite a
given paragraph, fix a bug in given code, extract fields from a given document. Open chat:
questions whose answers are new text, where a proposer finds little and speculation must not
cost (adaptivity turns it off). Each prompt is one user message, rendered by the model's chat
template.
"""

from __future__ import annotations

PARAGRAPH = (
    "Lighthouses were once kept by families who lived on the rocks for months at a time. "
    "The keeper climbed the tower every evening at sunset to light the lamp, trimmed the "
    "wick at midnight, and wound the clockwork that turned the lens until dawn. In bad "
    "weather he rang the fog bell by hand, sometimes for a whole night, so that ships could "
    "find their way past the reef. Supplies came by boat once a month, when the sea allowed "
    "it, and a keeper's children often learned to row before they learned to read. Today "
    "almost every lighthouse runs by itself, and the keepers' cottages are museums."
)

BUGGY_CODE = '''def average_word_length(text):
    """Return the mean length of the words in text, or 0.0 for an empty text."""
    words = text.split()
    total = 0
    for word in words:
        total += len(word)
    return total / len(words)


def longest_word(text):
    """Return the longest word in text (the first one on a tie)."""
    best = ""
    for word in text.split():
        if len(word) > len(best):
            best = word
    return best
'''

DOCUMENT = (
    "INVOICE No. 2024-0187\n"
    "Date: 14 March 2024\n"
    "From: Harbour Light Supplies Ltd, 12 Quay Street, Portsmouth PO1 3AB\n"
    "To: North Point Lighthouse Trust, Cliff Road, Whitby YO21 3PU\n"
    "Items: 2 x replacement lamp wick (GBP 18.50 each), 1 x brass fog bell clapper "
    "(GBP 96.00), 4 litres of lens polish (GBP 11.25 per litre)\n"
    "Subtotal: GBP 178.00\nVAT (20%): GBP 35.60\nTotal due: GBP 213.60\n"
    "Payment terms: 30 days from the invoice date, by bank transfer to account 40-12-77 "
    "31908844, reference 2024-0187."
)

COPY_HEAVY = (
    "Rewrite the following paragraph in the present tense, changing nothing else. Reply with "
    "the paragraph only.\n\n" + PARAGRAPH,
    "This Python code has a bug: average_word_length fails on an empty text. Reply with the "
    "whole corrected code, both functions, and nothing else.\n\n" + BUGGY_CODE,
    "Extract the invoice number, the date, the sender, the recipient, the total due and the "
    "payment reference from this invoice, as a JSON object with those six keys, copying each "
    "value exactly.\n\n" + DOCUMENT,
)

OPEN_CHAT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for staying healthy while working from home? Explain each.",
    "Explain why the sky is blue to a ten-year-old.",
)

WORKLOADS = {"copy-heavy": COPY_HEAVY, "open chat": OPEN_CHAT}
