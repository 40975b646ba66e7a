"""Constrained decoding: grammars compiled with llguidance, one matcher per request, the
batch's token bitmask per step (``grammar.py``), and the tool-call parsers (``tool_parsers.py``)."""
