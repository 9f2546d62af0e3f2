"""Autoscaling simulator: load traces through the planner and three baselines (python -m bench.autoscale)."""
