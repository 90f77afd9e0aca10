"""tiers — the reuse ladder and the tiers it climbs (docs/architecture.md: step 3).

- base.py: the one protocol every tier answers (find, load) and the words for it.
- ladder.py: the loop over tiers: plan, load, install, fall through.
- session.py: a tenant's live slots (continuations, never hits).
- resident.py, radix.py: cuts held in this process.
- durable.py: the vault's catalog and object store, the sole authority.
The remote tier (a peer through quarantine) lives in kvpack/remote/.
"""
