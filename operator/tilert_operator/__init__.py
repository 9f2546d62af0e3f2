"""The tilert-pd operator: the PDCluster API (spec, validation), pure renderers, and the kopf reconcile.

Layering: `spec`, `validation` and `render/` are pure (no Kubernetes client, no I/O); `kubeapi`,
`reconcile`, `status` and `wiring` are the edges that talk to the API server.
"""
