"""The handoff gap: from the prefill's first token to the decode node's first decoded token, per stage,
measured on the tiny CPU stack (run.py) and projected to GLM-5 on 8xB200 with RDMA (projection.py)."""
