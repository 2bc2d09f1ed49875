"""The adapter registry: promoted adapters as versions of an MLflow registered model, the served ones
named by aliases, their events on Redis pub/sub. Both the trainer (which registers and follows) and
the server (which follows and lets operators roll back) use it; it imports neither.

- client.py: `AdapterRegistry`: registering (and signing) versions, reading them;
- aliases.py: its alias moves and reads: promote, rollback, the champions, under the alias lock;
- connection.py: MLflow's client behind our errors (`RegistryError`, `RegistryUnavailable`);
- records.py: what a version holds in MLflow (params, metrics, tags) and the records read back;
- events.py: the `adaptive_spec:adapters` pub/sub channel, both ends;
- mlflow_store.py: opening MLflow, a new sqlite store created once under a lock.
"""
