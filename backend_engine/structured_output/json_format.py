"""How generated JSON is spaced, for every structured output: one space after ``,`` and ``:``,
on one line, as ``json.dumps`` writes it (and as models write it). No other whitespace is
allowed: flexible whitespace lets a small model loop on blank lines until ``max_tokens``.

The separators are the tool-call syntax's (``model_files/tool_call_syntax.py``), so a tool
call's arguments and a ``response_format`` answer are spaced alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from model_files import tool_call_syntax as syntax

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": syntax.ITEM_SEPARATOR,
    "key_separator": syntax.KEY_SEPARATOR,
    "whitespace_flexible": False,
}
