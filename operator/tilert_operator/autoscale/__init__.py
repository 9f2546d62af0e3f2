"""Autoscaling to a latency objective: what is observed (`inputs`), what is decided (`decision`), and
the one planner that decides (`planner`). Pure: no metrics are scraped and nothing is applied here;
docs/autoscaling.md says where the inputs come from and how a decision is acted on."""
