"""What every process of a cluster shares: the cluster secret and gRPC auth, the gRPC service
bring-up, config flags, the worker process base, the worker registry and leases, and the KV event
schema. Imports only ``model`` and ``proto`` below it; the roles, ``kvtransfer`` and ``deploy`` build
on it."""
