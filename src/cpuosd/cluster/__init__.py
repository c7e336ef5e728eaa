"""Many hosts (issue 24): what the roles (``--role=api|node``) are built on.

- ``membership``: nodes as ``coordination.k8s.io`` Leases (registration, heartbeat,
  capacity and facts, cordon, liveness) and leader election among API processes.
- ``testbed``: real Postgres, S3 and kube-apiserver processes for the tests and benchmarks.

The state store (cpuosd.store: SQLite or Postgres) and the snapshot store
(cpuosd.snapstore: directory or S3) are packages of their own. docs/DEPLOY.md has the design.
"""
