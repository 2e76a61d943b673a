"""Numbers and byte sizes as the plan writes them in its formulas and tables."""

from __future__ import annotations


def number_text(value: float) -> str:
    """Thousands separated, at most three decimals, no trailing zeros; from 10^9 on in
    engineering notation (8e9, 3.35e12, 989e12)."""
    if abs(value) >= 1e9:
        exponent = 3 * ((len(str(int(abs(value)))) - 1) // 3)
        return f"{value / 10**exponent:.4g}e{exponent}"
    if value == int(value):
        return f"{int(value):,}"
    return f"{value:,.3f}".rstrip("0").rstrip(".")


def bytes_text(value: float) -> str:
    """Decimal units with the binary ones beside them (the articles use both)."""
    for unit, size, binary, binary_size in (
        ("TB", 1e12, "TiB", 2**40),
        ("GB", 1e9, "GiB", 2**30),
        ("MB", 1e6, "MiB", 2**20),
        ("KB", 1e3, "KiB", 2**10),
    ):
        if value >= size:
            return f"{value / size:,.2f} {unit} ({value / binary_size:,.2f} {binary})"
    return f"{number_text(value)} B"
