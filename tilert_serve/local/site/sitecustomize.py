"""Imported at start by every Python process `tilert-pd local` runs and by those of the CPU vLLM image
(their PYTHONPATH has this folder, and TILERT_PD_PATCH_NIXL=1).

NIXL's progress thread busy-polls a whole core per agent unless its delay is raised (reference:
transfer-engines.md §3.3). vLLM's own NixlConnector creates such agents in the prefill and native
decode servers; on a laptop or a 2-core CI box two spinning agents starve every other component and
the native path times out. Patch the binding before any agent exists. GPU images leave it alone:
their nodes have cores to spare and RDMA progress wants the lowest latency.
"""

import os

if os.environ.get("TILERT_PD_PATCH_NIXL") == "1":
    try:
        from tilert_serve.transfer.nixl import import_nixl

        import_nixl()
    except Exception as exc:  # never keep a component from starting over this
        print(f"tilert-pd local: could not patch NIXL's progress thread: {exc}")
