"""Imported at start by every Python process `tilert-pd local` runs and by those of the CPU vLLM image
(their PYTHONPATH has this folder, and TILERT_PD_PATCH_NIXL=1).

NIXL's progress thread busy-polls a whole core per agent: NIXL's Python API makes every agent with a
delay of 0 between polls and takes no setting for it. vLLM's own NixlConnector creates such agents in
the prefill and native decode servers; on a laptop or a 2-core CI box two spinning agents starve
every other component and the native path times out. So these processes, and only these, make every
agent poll (transfer.nixl.poll_in_every_agent), before any agent exists. GPU images leave it alone:
their nodes have cores to spare and RDMA progress wants the lowest latency; the project's own engine
polls there too, on its agent only, without touching vLLM's.
"""

import os

if os.environ.get("TILERT_PD_PATCH_NIXL") == "1":
    try:
        from tilert_serve.transfer.nixl import poll_in_every_agent

        poll_in_every_agent()
    except Exception as exc:  # never keep a component from starting over this
        print(f"tilert-pd local: could not make NIXL's agents poll: {exc}")
