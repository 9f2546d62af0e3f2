"""Changes under load: each planned change (rolling updates, scale steps, a generation change) and
unplanned one (a SIGKILL of each component, the router restarted) made to the running tiny stack while
the load harness (bench/load) keeps score, judged against one bar.

    scenarios.py   the sequence of changes (pure data: how each edits the PDCluster, or what it kills)
    judge.py       each scenario's row and verdict from the load's records (pure)
    leaks.py       what the stack still holds once every request has ended
    __main__.py    the benchmark: python -m bench.change
"""
