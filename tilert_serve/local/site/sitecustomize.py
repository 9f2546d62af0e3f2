"""Imported at start by every Python process `tilert-pd local` runs (its PYTHONPATH has this folder).

NIXL's progress thread busy-polls a whole core per agent unless its delay is raised (reference:
transfer-engines.md §3.3). vLLM's own NixlConnector creates such agents in the prefill and native
decode servers; on a laptop or a 2-core CI box two spinning agents starve every other component and
the native path times out. Patch the binding before any agent exists. Pods have cores to spare and
are left alone.
"""

import os

if os.environ.get("TILERT_PD_PATCH_NIXL") == "1":
    try:
        from tilert_serve.transfer.nixl import import_nixl

        import_nixl()
    except Exception as exc:  # never keep a component from starting over this
        print(f"tilert-pd local: could not patch NIXL's progress thread: {exc}")
