"""Many hosts (issue 24): what the roles (``--role=api|node``) are built on.

- ``membership``: nodes as ``coordination.k8s.io`` Leases (registration, heartbeat,
  capacity and facts, cordon, liveness) and leader election among API processes.
- ``nodes``: a node's registration and heartbeat in the store, the API processes' view of
  the nodes, placement, fencing, the node token (``NodeTokenGuard``).
- ``api``: ``--role=api``, the public API forwarded to the nodes (built by
  ``cpuosd.wiring.build_api_services``).

The test bed (real Postgres, S3 and kube-apiserver processes for the tests and benchmarks)
is tests/support/testbed.py.

The state store (cpuosd.store: SQLite or Postgres) and the snapshot store
(cpuosd.snapstore: directory or S3) are packages of their own. docs/DEPLOY.md has the design.
"""
