"""`tilert-pd top`: a terminal view of a running stack, refreshed every second from the router's and
the TileRT nodes' `/metrics` (docs/observability.md, "tilert-pd top").

The pure core, each step a plain function over plain data:

    samples.parse(text)                        metrics text -> Samples
    view.build(previous, current, interval)    two rounds of scrapes -> View (rates over the interval)
    screen.lines(view)                         View -> the screen's lines

I/O stays in `sources.py` (where the stack is, one scrape) and `cli.py` (the loop and the terminal).
"""
