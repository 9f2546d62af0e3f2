"""pd_vllm."""
