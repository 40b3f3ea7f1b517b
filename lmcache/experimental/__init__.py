"""The seed documents' module paths (`lmcache.experimental.*`), part of the compat edge (see
`lmcache.compat`): aliases of the core modules, except `storage_backend.local_disk_backend`, whose
`LocalDiskBackend` carries seed 000's per-key calls (`lmcache.compat.disk_seed`). The core never
imports them."""
