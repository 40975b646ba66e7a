"""``tailserve demo``: the three layers, each shown on the same load with and without it (acts.py),
each act's verdict computed from its figures (verdicts.py), one HTML report (report.py)."""
